"""Packaging for DeepSpark: the `deepspark` library and console command."""

from setuptools import find_packages, setup

setup(
    name="deepspark",
    version="0.1.0",
    description="Caffe-defined networks trained on Apache Spark with asynchronous Elastic Averaging SGD",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="BSD-2-Clause",
    python_requires=">=3.11",
    packages=find_packages(include=["deepspark", "deepspark.*"]),
    # The schema's descriptor set with its comments: the help of the generated flags.
    package_data={"deepspark.proto": ["deepspark.desc"], "deepspark.spark": ["log4j2.properties"]},
    install_requires=[
        "numpy>=1.26",
        "protobuf>=6.31.1,<8",
        "lmdb>=1.4",
        "pillow>=10",
        "pyspark>=3.5",
        "matplotlib>=3.8",
        "tensorboard>=2.16",  # the training job's scalars
        # Parquet datasets (deepspark.data.parquet); deepspark.ml's transform (an Arrow UDF) and fit's rows, score and
        # extract-features (mapInArrow)
        "pyarrow>=14",
        "h5py>=3.10",  # HDF5Data and HDF5Output layers, snapshot_format: HDF5
        "cryptography>=42",  # the exchange's per-frame seal: AES-GCM (bench/seal.py)
        "pandas>=2.2,<3",  # pyspark's toPandas and Arrow paths (pyspark 4.3 wants >= 2.2 and warns on pandas 3)
        "tqdm>=4.66",  # the training job's per-worker progress bars, in a notebook as on a terminal
    ],
    extras_require={
        "tensorflow": ["tensorflow-cpu>=2.16"],
        "gpu": ["tensorflow[and-cuda]>=2.16"],  # TensorFlow with CUDA's libraries, for GPU nodes
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6", "import-linter>=2.1",
                 "pytest-timeout>=2.3",  # a test that hangs fails alone, its threads' stacks printed
                 "pyspark[connect]>=3.5",  # a local Spark Connect server for deepspark.ml's transform
                 # mlflow.pyspark.ml.autolog over a fit, in a sqlite store (the [mlflow] extra's)
                 "mlflow-skinny>=3.0", "sqlalchemy>=2.0,<2.1", "alembic>=1.13", "sqlparse>=0.5", "scipy>=1.11",
                 # tests/test_notebook.py: a notebook run in a real kernel (the [notebook] extra's, and its runner)
                 "ipykernel>=6.29", "ipywidgets>=8.1", "nbclient>=0.10", "nbformat>=5.10",
                 # the docs site, built in the suite (tests/test_docs.py)
                 "mkdocs>=1.6", "mkdocstrings-python>=1.10", "pymdown-extensions>=10", "pygments>=2.17"],
        "docs": ["mkdocs>=1.6", "mkdocstrings-python>=1.10", "pymdown-extensions>=10", "pygments>=2.17"],
        "connect": ["pyspark[connect]>=3.5"],
        # A Jupyter kernel on this environment's Python, the widgets tqdm draws a fit's per-worker bars with, and
        # what a fit's default backend runs (alone, [notebook] would leave a fit's workers without TensorFlow).
        "notebook": ["ipykernel>=6.29", "ipywidgets>=8.1", "tensorflow-cpu>=2.16"],
        # MLflow tracking over a fit: mlflow.pyspark.ml.autolog and the pyfunc model (deepspark/ml/flavor.py).
        # MLflow 3 keeps its local file store behind MLFLOW_ALLOW_FILE_STORE: sqlite ("sqlite:///mlflow.db") needs
        # sqlalchemy (2.1 warns of a deprecated loader at every run), alembic and sqlparse; autolog's dataset
        # logging infers schemas with scipy, and says so in a warning where it is missing.
        "mlflow": ["mlflow-skinny>=3.0", "sqlalchemy>=2.0,<2.1", "alembic>=1.13", "sqlparse>=0.5", "scipy>=1.11"],
        "caffe": ["six"],
        "bench": ["matplotlib>=3.8"],
    },
    entry_points={"console_scripts": ["deepspark = deepspark.cli:main"]},
)

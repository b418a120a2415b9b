"""A DeepSparkModel as an MLflow model: its Caffe files and Params with a python_function flavor that scores a pandas
DataFrame in this process (no Spark), logged by a fit under mlflow.pyspark.ml.autolog.

    import mlflow
    from deepspark.ml import flavor
    flavor.log_model(model, name="model")             # or a fit under mlflow.pyspark.ml.autolog()
    mlflow.pyfunc.load_model(uri).predict(pandas_df)  # prediction, probability (and outputBlobs) per row

The model's folder holds MLmodel, the environment files and data/: deploy.prototxt, weights.caffemodel (and
mean.binaryproto), Caffe's own files as a saved DeepSparkModel holds them, and params.json, its Params. predict takes
the rows' images from the inputCol column (Spark ML vectors, as toPandas gives them, or arrays, flat or nested), or,
where the DataFrame has no such column, each row's own values as one flat image; inputShape gives their (C, H, W)
where the images are larger than the net's input (a crop). The deploy net runs on the model's backend as transform
runs it on an executor (ml/columns.py), inputScale as transform chooses it, so the outputs are transform's.

mlflow.pyspark.ml.autolog logs a model only when its class is on autolog's allowlist (pyspark's own models), and
then as a Spark model that needs a SparkSession to load. So a fit logs its model itself (autologged, the
estimator's hook) when autolog is on with log_models, and autolog's "not allowlisted" warning for that fit's model
(or the PipelineModel holding it) is left out: the pyfunc holds the DeepSpark stage alone, its input the stage's,
and answers the class names a StringIndexer before it indexed (LABEL_COLUMN) beside its index. A fit that fails
under autolog deletes the run autolog started for it (discard_run).
mlflow is imported only where it is used: it is an optional dependency, and slow to import.
"""

import dataclasses
import importlib.metadata
import json
import logging
import os
import sys
import warnings

import numpy as np
import pandas as pd
import pyarrow as pa
from google.protobuf import text_format

from deepspark import config
from deepspark.data import datum
from deepspark.errors import ConfigError
from deepspark.ml import frames, images
from deepspark.ml.columns import Held, outputs_of
from deepspark.ml.images import ARRAY
from deepspark.ml.model import DeepSparkModel, parse_shape, parse_transform
from deepspark.ml.persist import DEPLOY, MEAN, WEIGHTS

log = logging.getLogger(__name__)
FLAVOR = "deepspark"
DATA = "data"  # the model's own files, under the MLflow model's folder
PARAMS = "params.json"
# What mlflow.pyspark.ml.autolog says of a fitted model not on its allowlist (mlflow/pyspark/ml/__init__.py).
NOT_ALLOWLISTED = "will not be autologged because it is not allowlisted"
# The pyfunc's column of class names (IndexToString's outputCol in Spark ML's examples): a Pipeline logged under
# autolog holds only the DeepSpark stage, whose prediction is the StringIndexer's index, not the user's label.
LABEL_COLUMN = "predictedLabel"
_LOGGED_RUNS = set()  # the runs a fit logged its model in: autolog's warning about them is left out


def save_model(deepspark_model, path, mlflow_model=None, pip_requirements=None, extra_pip_requirements=None,
               signature=None, input_example=None, metadata=None):
    """Save `deepspark_model` (a DeepSparkModel) as an MLflow model in the local folder `path` (a new one)."""
    import yaml
    from mlflow import pyfunc
    from mlflow.models import Model
    from mlflow.models.model import MLMODEL_FILE_NAME
    from mlflow.models.utils import _save_example
    from mlflow.utils import environment as env

    model = deepspark_model
    if os.path.exists(path):
        raise ConfigError(f"an MLflow model's folder '{path}' exists already; name a new one")
    data = os.path.join(path, DATA)
    os.makedirs(data)
    files = {DEPLOY: text_format.MessageToString(model.deploy).encode(), WEIGHTS: model.weights}
    if model.mean is not None:
        files[MEAN] = datum.mean_bytes(model.mean)
    for name, content in files.items():
        with open(os.path.join(data, name), "wb") as out:
            out.write(content)
    params = {"uid": model.uid, "set": {p.name: v for p, v in model._paramMap.items()},
              "default": {p.name: v for p, v in model._defaultParamMap.items()}, "history": model.getHistory(),
              "labels": model.getLabels()}
    with open(os.path.join(data, PARAMS), "w", encoding="utf-8") as out:
        json.dump(params, out, indent=1)

    mlflow_model = mlflow_model or Model()
    if signature is not None:
        mlflow_model.signature = signature
    if input_example is not None:
        _save_example(mlflow_model, input_example, path)
    if metadata is not None:
        mlflow_model.metadata = metadata
    pyfunc.add_to_model(mlflow_model, loader_module=__name__, data=DATA, conda_env=env._CONDA_ENV_FILE_NAME,
                        python_env=env._PYTHON_ENV_FILE_NAME)
    mlflow_model.add_flavor(FLAVOR, data=DATA, deepspark_version=_version("deepspark"),
                            backend=model.getOrDefault("backend"))
    mlflow_model.save(os.path.join(path, MLMODEL_FILE_NAME))

    conda_env, requirements, constraints = env._process_pip_requirements(
        requirements_of(model), pip_requirements, extra_pip_requirements)
    with open(os.path.join(path, env._CONDA_ENV_FILE_NAME), "w", encoding="utf-8") as out:
        yaml.safe_dump(conda_env, stream=out, default_flow_style=False)
    if constraints:
        with open(os.path.join(path, env._CONSTRAINTS_FILE_NAME), "w", encoding="utf-8") as out:
            out.write("\n".join(constraints))
    with open(os.path.join(path, env._REQUIREMENTS_FILE_NAME), "w", encoding="utf-8") as out:
        out.write("\n".join(requirements))
    env._PythonEnv.current().to_yaml(os.path.join(path, env._PYTHON_ENV_FILE_NAME))


def _version(package):
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def requirements_of(model):
    """The pip requirements of scoring `model`: DeepSpark and its backend's package, pinned to what runs here."""
    backend = "tensorflow-cpu" if model.getOrDefault("backend") == "tensorflow" else None
    packages = ["deepspark", "numpy", "pandas", "pyarrow", "protobuf"] + ([backend] if backend else [])
    return [f"{name}=={_version(name)}" if _version(name) else name for name in packages]


def log_model(deepspark_model, name="model", **kwargs):
    """Log `deepspark_model` as an MLflow model of the active run (one is started if none is): its ModelInfo.
    kwargs: those of mlflow.models.Model.log (registered_model_name, ...) and of save_model."""
    from mlflow.models import Model

    return Model.log(artifact_path=None, name=name, flavor=sys.modules[__name__], deepspark_model=deepspark_model,
                     **kwargs)


def load(path):
    """The DeepSparkModel of an MLflow model's data folder (save_model's), checked as a loaded Model is."""
    deploy = config.parse_net(_read(path, DEPLOY).decode(), os.path.join(path, DEPLOY))[0]
    mean = datum.parse_mean(_read(path, MEAN), os.path.join(path, MEAN)) \
        if os.path.exists(os.path.join(path, MEAN)) else None
    with open(os.path.join(path, PARAMS), encoding="utf-8") as saved:
        params = json.load(saved)
    model = DeepSparkModel(_files=(deploy, _read(path, WEIGHTS), mean))
    model._resetUid(params["uid"])
    model._setDefault(**params["default"])
    model._set(**params["set"])
    model.history = params.get("history", [])
    model.labels = params.get("labels")
    model._check(os.path.join(path, WEIGHTS))
    return model


def _read(folder, name):
    with open(os.path.join(folder, name), "rb") as saved:
        return saved.read()


def _load_pyfunc(path):
    """MLflow's python_function loader: `path` is the model's data folder."""
    return Scorer(load(path))


class Scorer:
    """predict(pandas DataFrame) -> a DataFrame of the model's output columns, one row per input row, in order (with
    handleInvalid 'skip', the rows without an image of the net's shape left out), and, for a model fitted on a
    StringIndexer's labels (a Pipeline's), each prediction's class name in LABEL_COLUMN."""

    def __init__(self, model):
        self.model = model

    def predict(self, model_input, params=None):
        model = self.model
        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        column = model.getOrDefault("inputCol")
        rows = frame[column] if column in frame.columns else list(frame.to_numpy())
        values = pa.array([None if row is None else np.asarray(row.toArray() if hasattr(row, "toArray") else row,
                                                               np.float64).ravel() for row in rows],
                          pa.list_(pa.float64()))
        given = model.getOrDefault("inputShape")
        inputs = frames.Inputs(column, ARRAY, 1, parse_shape(given) if given else model.input_top()[1])
        columns = model.output_columns()
        scale = self.scale(values, inputs)
        forward = model.forward([name for _, name, _ in columns], scale)
        # The weights read as a broadcast is; every core of this process (Forward.of's one thread is an executor's
        # share of its machine): where TensorFlow already runs (a fit in the same kernel) it has them already.
        forward = dataclasses.replace(forward, weights=Held(forward.weights), threads=len(os.sched_getaffinity(0)))
        skip = model.getOrDefault("handleInvalid") == "skip"
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "TensorFlow already runs with its default thread counts", RuntimeWarning)
            struct = next(outputs_of(forward, inputs, columns, skip)(iter([values])))
        out = pd.DataFrame({name: struct.field(name).to_pandas() for _, _, name in columns})
        labels = model.getLabels()
        if labels is not None and "prediction" in out:  # the class names, as IndexToString gives them after transform
            out[LABEL_COLUMN] = [None if np.isnan(p) else labels[int(p)] for p in out["prediction"]]
        if skip:
            out = out[np.asarray(struct.is_valid())].reset_index(drop=True)
        return out

    def scale(self, values, inputs):
        """inputScale as the model's transform takes it: as set, else as the images need it (images.input_scale)."""
        model = self.model
        if model.isSet("inputScale") and model.getOrDefault("inputScale") > 0:
            return model.getOrDefault("inputScale")
        found = images.column_images(values.drop_null()[:frames.SAMPLE_ROWS], ARRAY, inputs.shape)[0]  # frames.head's
        if not found.size:
            return model.getOrDefault("inputScale") or 1.0
        return images.input_scale(found, parse_transform(model.getOrDefault("transformParam")).scale)


def autologged(model):
    """A fit's hook: `model` logged as the MLflow model "model" of the active run where mlflow.pyspark.ml.autolog is
    on and logs models (autolog logs only the models on its allowlist); a model that could not be logged is said in
    one line, and the fit goes on."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or mlflow.active_run() is None:
        return None
    from mlflow.utils.autologging_utils import autologging_is_disabled, get_autologging_config

    if autologging_is_disabled("pyspark.ml") or not get_autologging_config("pyspark.ml", "log_models", True):
        return None
    try:
        info = log_model(model, name="model")
    except Exception as error:  # a tracking store's failure: the fit's model is still the caller's
        log.warning(f"MLflow: the fitted model was not logged ({type(error).__name__}: {error})")
        return None
    _LOGGED_RUNS.add(mlflow.active_run().info.run_id)
    quiet = logging.getLogger("mlflow.pyspark.ml")
    if not any(isinstance(f, _LoggedHere) for f in quiet.filters):
        quiet.addFilter(_LoggedHere())
    return info


def discard_run():
    """The MLflow run that autolog started for a fit that failed, ended and deleted: a failed fit (a bad Param, a
    job that failed) leaves no FAILED run in the experiment; a run the user started stays theirs, as it is."""
    mlflow = sys.modules.get("mlflow")
    run = mlflow.active_run() if mlflow is not None else None
    if run is None:
        return
    from mlflow.utils.mlflow_tags import MLFLOW_AUTOLOGGING

    try:
        if MLFLOW_AUTOLOGGING not in mlflow.get_run(run.info.run_id).data.tags:
            return
        mlflow.end_run("FAILED")  # autolog's own end of it then finds no run to end
        mlflow.delete_run(run.info.run_id)
    except Exception as error:  # a tracking store's failure: the fit's own error is the one to raise
        log.warning(f"MLflow: the failed fit's run {run.info.run_id} was not deleted ({type(error).__name__}: "
                    f"{error})")


class _LoggedHere(logging.Filter):
    """Leaves out autolog's "not allowlisted" warning in a run a fit logged its model in."""

    def filter(self, record):
        if NOT_ALLOWLISTED not in record.getMessage():
            return True
        mlflow = sys.modules.get("mlflow")
        run = mlflow.active_run() if mlflow is not None else None
        return run is None or run.info.run_id not in _LOGGED_RUNS

"""A Model's persistence with pyspark.ml's writers: its Params as pyspark.ml's metadata and its net as Caffe's own
files under data/ (deploy.prototxt, weights.caffemodel, mean.binaryproto), on any path Spark's Hadoop file systems
write: a local folder, hdfs://, s3a://."""

from google.protobuf import text_format
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from deepspark import config
from deepspark.data import datum

# Files of a saved Model, under its path's data/ folder: Caffe's own, loadable by Caffe as they are.
DEPLOY, WEIGHTS, MEAN = "deploy.prototxt", "weights.caffemodel", "mean.binaryproto"


class ModelWriter(MLWriter):
    """Saves a Model (its deploy NetParameter, weights bytes and mean image or None) and its Params."""

    def __init__(self, instance):
        super().__init__()
        self.instance = instance

    def saveImpl(self, path):
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sc)
        files = {DEPLOY: text_format.MessageToString(self.instance.deploy).encode(), WEIGHTS: self.instance.weights}
        if self.instance.mean is not None:
            files[MEAN] = datum.mean_bytes(self.instance.mean)
        for name, data in files.items():
            write_file(self.sc, f"{path}/data/{name}", data)


class ModelReader(MLReader):
    """Loads what ModelWriter saved as a `cls` (its uid the saved one's), checked as from_caffe checks."""

    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path):
        sc = self.sparkSession.sparkContext
        metadata = DefaultParamsReader.loadMetadata(path, sc)
        deploy = config.parse_net(read_file(sc, f"{path}/data/{DEPLOY}").decode(), f"{path}/data/{DEPLOY}")[0]
        mean_path = f"{path}/data/{MEAN}"
        mean = datum.parse_mean(read_file(sc, mean_path), mean_path) if exists(sc, mean_path) else None
        model = self.cls(_files=(deploy, read_file(sc, f"{path}/data/{WEIGHTS}"), mean))
        model._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(model, metadata)
        model._check()
        return model


# -- files through Spark's Hadoop file systems (what pyspark.ml's own writers use) --------------


def _hadoop(sc, path):
    jvm_path = sc._jvm.org.apache.hadoop.fs.Path(path)
    return jvm_path.getFileSystem(sc._jsc.hadoopConfiguration()), jvm_path


def write_file(sc, path, data, chunk=1 << 24):
    fs, jvm_path = _hadoop(sc, path)
    stream = fs.create(jvm_path, True)
    try:
        for start in range(0, len(data), chunk):
            stream.write(bytearray(data[start:start + chunk]))
    finally:
        stream.close()


def read_file(sc, path):
    fs, jvm_path = _hadoop(sc, path)
    stream = fs.open(jvm_path)
    try:
        return bytes(stream.readAllBytes())
    finally:
        stream.close()


def exists(sc, path):
    fs, jvm_path = _hadoop(sc, path)
    return bool(fs.exists(jvm_path))

"""A Model's persistence with pyspark.ml's writers: its Params as pyspark.ml's metadata, its net as Caffe's own files
under data/ (deploy.prototxt, weights.caffemodel, mean.binaryproto) and its fit's history, summary and class names
as JSON (data/history.json). In classic Spark on any path Spark's Hadoop file systems write (a local folder, hdfs://,
s3a://); under Spark Connect, which has no JVM on the client, the metadata through Spark's DataFrame writer and the
files as plain files: a local folder or file: URI, which a local Connect server shares with its client."""

import json
import os
import shutil
import urllib.parse

from google.protobuf import text_format
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from deepspark import config
from deepspark.data import datum
from deepspark.errors import ConfigError
from deepspark.spark.session import is_connect

# Files of a saved Model, under its path's data/ folder: Caffe's own, loadable by Caffe as they are, and the fit's.
DEPLOY, WEIGHTS, MEAN, HISTORY = "deploy.prototxt", "weights.caffemodel", "mean.binaryproto", "history.json"


class ModelWriter(MLWriter):
    """Saves a Model (its deploy NetParameter, weights bytes and mean image or None, its history and summary) and its
    Params."""

    def __init__(self, instance):
        super().__init__()
        self.instance = instance

    def save(self, path):
        files = Files(self.sparkSession, path)
        if self.shouldOverwrite:
            files.remove()
        self.saveImpl(path)

    def saveImpl(self, path):
        files = Files(self.sparkSession, path)
        DefaultParamsWriter.saveMetadata(self.instance, path, self.sparkSession)
        model = self.instance
        data = {DEPLOY: text_format.MessageToString(model.deploy).encode(), WEIGHTS: model.weights,
                HISTORY: json.dumps({"history": model.history, "summary": model.summary,
                                     "labels": model.labels}, default=plain).encode()}
        if model.mean is not None:
            data[MEAN] = datum.mean_bytes(model.mean)
        for name, value in data.items():
            files.write(f"data/{name}", value)


class ModelReader(MLReader):
    """Loads what ModelWriter saved as a `cls` (its uid the saved one's), checked as from_caffe checks."""

    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path):
        files = Files(self.sparkSession, path)
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        deploy = config.parse_net(files.read(f"data/{DEPLOY}").decode(), f"{path}/data/{DEPLOY}")[0]
        mean_path = f"{path}/data/{MEAN}"
        mean = datum.parse_mean(files.read(f"data/{MEAN}"), mean_path) if files.exists(f"data/{MEAN}") else None
        model = self.cls(_files=(deploy, files.read(f"data/{WEIGHTS}"), mean))
        model._resetUid(metadata["uid"])
        DefaultParamsReader.getAndSetParams(model, metadata)
        if files.exists(f"data/{HISTORY}"):  # a model saved before the history travelled with it has none
            fitted = json.loads(files.read(f"data/{HISTORY}"))
            model.history, model.summary = fitted["history"], fitted["summary"]
            model.labels = fitted.get("labels")  # saved before labels travelled: none
        model._check()
        return model


def plain(value):
    """A value json cannot write as it is (a numpy number) as one it can."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


class Files:
    """The files under a saved Model's `path`: through Spark's Hadoop file systems in classic Spark, as plain files
    under Spark Connect (a local path or file: URI; one line for another)."""

    def __init__(self, session, path):
        self.path = path
        self.sc = None if is_connect(session) else session.sparkContext
        if self.sc is None:
            where = urllib.parse.urlparse(path)
            if where.scheme not in ("", "file"):
                raise ConfigError(f"under Spark Connect a DeepSparkModel saves and loads on a local path or a file: "
                                  f"URI, which the client writes; '{path}' is {where.scheme}: save it in classic "
                                  "Spark, whose Hadoop file systems write it")
            self.local = where.path if where.scheme else path

    def _hadoop(self, name):
        jvm_path = self.sc._jvm.org.apache.hadoop.fs.Path(f"{self.path}/{name}" if name else self.path)
        return jvm_path.getFileSystem(self.sc._jsc.hadoopConfiguration()), jvm_path

    def write(self, name, data, chunk=1 << 24):
        if self.sc is None:
            target = os.path.join(self.local, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target + ".part", "wb") as out:  # renamed once whole: nothing half-written
                out.write(data)
            os.replace(target + ".part", target)
            return
        fs, jvm_path = self._hadoop(name)
        stream = fs.create(jvm_path, True)
        try:
            for start in range(0, len(data), chunk):
                stream.write(bytearray(data[start:start + chunk]))
        finally:
            stream.close()

    def read(self, name):
        if self.sc is None:
            with open(os.path.join(self.local, name), "rb") as source:
                return source.read()
        fs, jvm_path = self._hadoop(name)
        stream = fs.open(jvm_path)
        try:
            return bytes(stream.readAllBytes())
        finally:
            stream.close()

    def exists(self, name=None):
        if self.sc is None:
            return os.path.exists(os.path.join(self.local, name) if name else self.local)
        fs, jvm_path = self._hadoop(name)
        return bool(fs.exists(jvm_path))

    def remove(self):
        """The saved model's folder gone (overwrite), if it is there."""
        if self.sc is None:
            shutil.rmtree(self.local, ignore_errors=True)
            return
        fs, jvm_path = self._hadoop(None)
        if fs.exists(jvm_path):
            fs.delete(jvm_path, True)


"""DeepSpark as pyspark.ml stages: an Estimator whose fit trains on a DataFrame, and the Model it returns, a
Transformer that runs the deploy net on the executors.

    from pyspark.ml import Pipeline
    from pyspark.ml.feature import StringIndexer
    from deepspark.ml import DeepSparkEstimator, DeepSparkModel
    estimator = DeepSparkEstimator(solver="models/lenet/solver.prototxt", inputCol="features",
                                   labelCol="index", validationFraction=0.1, maxIter=2000)
    model = Pipeline(stages=[StringIndexer(inputCol="class", outputCol="index"), estimator]).fit(train_df)
    model.transform(test_df).select("prediction", "probability")
    model.save("lenet_model")                  # pyspark.ml persistence; data/ holds
                                               # deploy.prototxt and weights.caffemodel
    DeepSparkModel.from_caffe("models/lenet/deploy.prototxt", "lenet.caffemodel",
                              transform="scale: 0.00390625")

The Params are the schema's: one per field of DeepSparkParameter (how to train), ScoreParameter (which columns, which
blobs, the input's shape and scale, what to do with an invalid row) and ValidationParameter (what fit holds out),
named in Spark's camelCase (movingRate for moving_rate), typed, documented and defaulted from
proto/deepspark.proto. A DeepSparkParameter Param left unset keeps what the solver's prototxt (or the
deepspark.prototxt beside it) says, as `deepspark train` does with a flag not given; its default shows that value.

A net whose output a Softmax layer makes fills probabilityCol (class probabilities); one without (raw scores, logits)
fills rawPredictionCol instead, as Spark ML's classifiers name them. A saved model keeps its fit's history and
summary (getHistory(), .summary) and its inputScale.

Under Spark Connect, transform, save and load run (a save on a local path or file: URI); fit needs classic Spark. A
Connect server's executors run `python3` from the server's PATH unless it was started with PYSPARK_PYTHON: start it
from a Python that has deepspark, pyarrow, numpy and the backend (PYSPARK_PYTHON=/path/to/venv/bin/python
$SPARK_HOME/sbin/start-connect-server.sh, or a client's SparkSession.builder.remote("local[N]") with PYSPARK_PYTHON
set in its environment); transform asks them once per session and says in one line which Python they run and what
it lacks.
"""

from deepspark.ml.estimator import DeepSparkEstimator
from deepspark.ml.model import DeepSparkModel

# pyspark.ml's metadata names a stage by its class's module: the package's, whichever module defines it.
DeepSparkEstimator.__module__ = DeepSparkModel.__module__ = __name__

__all__ = ["DeepSparkEstimator", "DeepSparkModel"]

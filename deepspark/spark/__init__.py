"""Training on Spark: the driver-side job and the executor-side worker loop."""

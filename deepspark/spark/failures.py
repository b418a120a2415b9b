"""What the driver says when Spark fails: the one line of Spark's report that says why, and what Spark says of its executors."""

import re

from deepspark.errors import DeepSparkError


class JobError(DeepSparkError):
    """The job cannot go on; the message says what happened and what Spark reports; `detail`, Spark's whole report
    (the Python traceback and the Java stack), is for the log file."""

    def __init__(self, message, detail=None):
        super().__init__(message)
        self.detail = detail


def executor_report(sc, listing=False):
    """What Spark says about its executors (the driver's among them), for error messages; with `listing`,
    the executors but the driver as {id: "HOST:PORT"} instead (None when Spark cannot say), for the watch
    to see one go."""
    try:
        if listing:  # the status store's list has the executors' ids (the driver's is "driver")
            active = sc._jsc.sc().statusStore().executorList(True)
            return {e.id(): e.hostPort() for e in map(active.apply, range(active.size())) if e.id() != "driver"}
        infos = sc._jsc.sc().statusTracker().getExecutorInfos()
        hosts = [f"{info.host()}:{info.port()} ({info.numRunningTasks()} running)" for info in infos]
        return f"Spark reports {len(hosts)} executor(s): {', '.join(hosts) or 'none'}"
    except Exception as error:  # only used to enrich a message
        return None if listing else f"Spark's executor list is unavailable ({error})"


# Py4J puts the Java exception on a line of its own after ": " (": org.apache.spark.SparkException: Job aborted ...").
_EXCEPTION_LINE = re.compile(r"^\s*(?::\s*)?([\w.]+(?:Error|Exception)): (.+)$")
# Spark's abort names the task, its failures and the last one's cause, which is what a user needs of it.
_STAGE_FAILURE = re.compile(r"Job aborted due to stage failure: (Task \S+ in stage \S+ failed \d+ times?), most recent "
                            r"failure: Lost task [^:]*: (?:[\w.]+(?:Error|Exception): )?(.+?)(?:\. |\.?$)")


def first_line(error):
    """The one line that says why a Spark job failed: our own error's message if a worker raised one,
    else the first Python exception, else the first exception named anywhere in Spark's report (a stage's
    abort as its task, failures and the last failure's cause)."""
    text = str(error).strip()
    found = [m.groups() for m in map(_EXCEPTION_LINE.match, text.splitlines()) if m]
    ours = [message for name, message in found if name.startswith("deepspark.")]
    if ours:
        return ours[0].strip()
    python = [(name, message) for name, message in found if not name.startswith(("org.", "java.", "py4j.", "scala."))]
    if python or found:
        name, message = (python or found)[0]
        aborted = _STAGE_FAILURE.search(message)
        if aborted:
            return f"{aborted.group(1)}, the last: {aborted.group(2)}"
        return f"{name.rsplit('.', 1)[-1]}: {message.strip()}"
    return text.splitlines()[0] if text else type(error).__name__


def failed(error, sc):
    """The JobError for a Spark job that raised `error`."""
    line = first_line(error)
    if not re.search(r"No module named '?deepspark\b", line):
        # The executors' daemon is ours (session.DAEMON): Spark gives its import error past the first line.
        daemon = re.search(r"ModuleNotFoundError: No module named '?deepspark\b[\w.]*'?", str(error))
        line = daemon.group(0) if daemon else line
    if re.search(r"No module named '?deepspark\b", line):
        line = (f"the executors' Python cannot import deepspark ({line}); ship an environment that has it: "
                f"--executor-env ENV.tar.gz (tools/pack-env.sh packs one), or spark-submit --archives "
                f"ENV.tar.gz#environment with PYSPARK_PYTHON=./environment/bin/python, or install deepspark on "
                f"every node")
    return JobError(f"the Spark job failed: {line}; {executor_report(sc)}", detail=str(error))


def interrupted(error):
    """The KeyboardInterrupt (SIGINT, or SIGHUP as job.HungUp) that `error` was raised while handling, else None. A
    signal cuts the main thread's Py4J call short and Py4J shuts that call's connection; the next call on the way out
    (pyspark's call-site `with` around an action) can then fail on a new connection ("Answer from Java side is
    empty"), and Python raises that error in the interrupt's place."""
    for _ in range(8):
        if error is None or isinstance(error, KeyboardInterrupt):
            return error
        error = error.__context__
    return None


# Spark's own advice at the end of a crashed Python worker's report, which is no cause.
_ADVICE = re.compile(r"\.?\s+Consider setting .*$", re.S)


def task_cause(message):
    """The one line of a failed task's report (Spark's errorMessage) that says why."""
    return _ADVICE.sub("", first_line(message)) if message else "no reason given"


def failed_tasks(sc, group, seen):
    """Spark's tasks of job group `group` that failed since the last call, as [(partition, cause, (stage, attempt), when
    it ended (s since the epoch, the driver's clock))], each stage attempt's in the order they ended; `seen` ({stage:
    (attempt, ids of its failed tasks seen)}, updated) is what earlier calls saw. Every attempt of a stage is read, a
    barrier stage's reruns among them: Spark's status store has a failed task before the attempt after it (its
    listener's events come in order). A failure is known by its task id, not by its place in Spark's list: tasks fail in
    another order than their ids (a retry, launched later, can fail before the first attempt of another partition), and
    an offset into a list in another order than the failures' reads one already counted in place of the new one, under
    the wrong worker. A look Spark cannot answer (its context stopping) returns what it read: the rest is read by the
    next."""
    tracker = sc.statusTracker()
    found = []
    try:
        for job in filter(None, map(tracker.getJobInfo, tracker.getJobIdsForGroup(group))):
            for stage_id in job.stageIds:
                stage = tracker.getStageInfo(stage_id)
                attempt, ids = seen.get(stage_id, (0, frozenset()))
                if stage is None or (stage.currentAttemptId == attempt and stage.numFailedTasks <= len(ids)):
                    continue
                read = []
                while True:
                    tasks = [t for t in stage_failures(sc, stage_id, attempt) if t[1] not in ids]
                    read += [(partition, cause, (stage_id, attempt), ended / 1000)
                             for ended, _, partition, cause in sorted(tasks)]
                    if attempt == stage.currentAttemptId:
                        break
                    attempt, ids = attempt + 1, frozenset()
                seen[stage_id] = (attempt, ids | {task_id for _, task_id, _, _ in tasks})
                found += read
    except Exception:  # Py4J's error as the context stops: the job's own end says what happened
        pass
    return found


def stage_failures(sc, stage_id, attempt):
    """[(when it ended (ms), task id, partition, cause)] of the failed tasks of attempt `attempt` of stage
    `stage_id`. The partition is the task's partition id (a worker's rank), not its index in the attempt's task set,
    which differs from it in an attempt that reruns only some partitions."""
    v1 = sc._jvm.org.apache.spark.status.api.v1
    statuses = sc._jvm.java.util.ArrayList()
    statuses.add(v1.TaskStatus.FAILED)
    tasks = sc._jsc.sc().statusStore().taskList(stage_id, attempt, 0, 1 << 30, v1.TaskSorting.ID, statuses)
    out = []
    for task in map(tasks.apply, range(tasks.size())):
        message = task.errorMessage()
        ran = task.duration()
        ended = task.launchTime().getTime() + (ran.get() if ran.isDefined() else 0)
        out.append((ended, task.taskId(), task.partitionId(), task_cause(message.get() if message.isDefined() else "")))
    return out

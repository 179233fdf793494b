"""What each epoch's end decides: the best epoch, --patience, the time to --target-accuracy.

Every rank decides alike (from the same all-reduced figures). It writes nothing: the recorder
writes what it decided."""
from multi_train_utils.single_label import SingleLabel
from multi_train_utils.summary import format_duration


class EpochDecider:
    """The decisions of a run of ``task`` whose TrainState is ``state`` (its ``best`` and
    ``stop_reason`` are kept up to date), by ``run``'s best_metric, patience and
    target_accuracy (the flags' run section). ``checkpoint``: the one a run resumes from, whose
    epoch may already have used up the patience."""

    def __init__(self, state, task, run, checkpoint=None):
        self.state, self.task = state, task or SingleLabel()
        self.metric, self.patience, self.target = run.best_metric, run.patience, run.target_accuracy
        if checkpoint:
            state.stop_reason = self.patience_ran_out(int(checkpoint["epoch"]))

    def end_epoch(self, epoch, eval_result, ema_result=None):
        """After ``epoch``: the best epoch (the model's or its EMA's, whichever scored better),
        then --patience; returns which of the two scored better this epoch ("model" on a tie)."""
        self.state.epoch = epoch + 1
        source = self.update_best(epoch, eval_result, ema_result)
        self.state.stop_reason = self.patience_ran_out(epoch)
        return source

    def update_best(self, epoch, eval_result, ema_result=None):
        """The state's best epoch, if the model or its EMA (whichever scores better) beat it;
        returns which of the two scored better this epoch."""
        metric, best, task = self.metric, self.state.best, self.task
        source, result = "model", eval_result
        if ema_result is not None and task.is_better(metric, ema_result.metric(metric), eval_result.metric(metric)):
            source, result = "ema", ema_result
        if task.is_better(metric, result.metric(metric), best.value):
            best.value, best.accuracy, best.epoch, best.source = result.metric(metric), result.accuracy, epoch, source
            kept = task.keep(result)
            best.confusion, best.report = kept["confusion"], kept["report"]
        return source

    def patience_ran_out(self, epoch):
        """Why the run ends after ``epoch`` under --patience, or None if it goes on."""
        patience, best = self.patience, self.state.best
        if patience and best.epoch >= 0 and epoch - best.epoch >= patience:
            return (f"stopped early after epoch {epoch}: no better val {self.metric} for {patience} "
                    f"epochs (--patience {patience}; best at epoch {best.epoch})")
        return None

    def time_to_target(self, rows, header):
        """The end summary's line on the run's clock (metrics.csv's run_seconds, of ``rows`` in
        the order of ``header``): the time to the best epoch and, with --target-accuracy, when
        the task's headline (val accuracy; multi-label: mAP), of the model or its EMA, first
        reached it."""
        return time_to_target(self.target, rows, self.state.best.epoch, self.task, header)


def time_to_target(target, rows, best_epoch, task, header):
    """EpochDecider.time_to_target, of ``target`` (--target-accuracy, or None) and ``best_epoch``."""
    name, label = task.headline
    rows = [dict(zip(header, row)) for row in rows]
    seconds = {int(r["epoch"]): float(r["run_seconds"]) for r in rows if r.get("run_seconds") not in (None, "")}
    parts = []
    if best_epoch in seconds:
        parts.append(f"the best epoch ({best_epoch}) after {format_duration(seconds[best_epoch])} of training")
    if target is not None:
        reached = [int(r["epoch"]) for r in rows
                   if max(float(r[f"val_{name}"] or "nan"), float(r[f"ema_val_{name}"] or "nan")) >= target]
        if reached and reached[0] in seconds:
            parts.append(f"val {label} {target:g} first reached at epoch {reached[0]}, after "
                         f"{format_duration(seconds[reached[0]])}")
        else:
            parts.append(f"val {label} never reached --target-accuracy {target:g}")
    return "run clock: " + "; ".join(parts) if parts else None

"""What the end of each epoch decides, what rank 0 writes and prints about a run.

``EpochDecider`` decides, on every rank alike: the best epoch, whether --patience ran out, the
time to --target-accuracy. ``RunRecorder`` writes what it decided and nothing else: checkpoint,
weights, metrics.csv, args.json, TensorBoard, pictures. Then what rank 0 prints: the start
summary, the epoch line, the end summary and --eval-only's report.
"""
import contextlib
import math
import os
import time
import weakref

import torch
import torch.distributed as dist

from multi_train_utils.checkpoint import (CHECKPOINT, TrainState, build_checkpoint, complete_checkpoint, resumes_in,
                                          save_checkpoint, set_aside_damaged_checkpoint)
from multi_train_utils.datasets import DEMO_MARKER, images_info
from multi_train_utils.distributed_utils import (current_job, get_world_size, is_dist_avail_and_initialized,
                                                 is_main_process)
from multi_train_utils.errors import MidRunError, arm_notices, loader_failure, one_line, printable, resource_error
from multi_train_utils.files import cpu_tensors, folder_bytes, format_bytes, link_atomic, save_atomic
from multi_train_utils.images import JPEG_DECODER
from multi_train_utils.loaders import (imbalance_warning, is_multi_hot, label_counts, labels_per_image,
                                       positives_per_class, training_labels)
from multi_train_utils.model_setup import count_parameters, plain_state_dict
from multi_train_utils.pictures import (PLOT_FILES, plot_batch_preview, plot_class_distribution,
                                        plot_label_distribution, plot_training_curves, save_figure)
from multi_train_utils.run_files import (BEST_WEIGHTS, clear_earlier_run, file_list_fingerprint, images_of,
                                         metrics_header, model_epoch_files, resume_hint, write_metrics,
                                         write_run_settings)
from multi_train_utils.single_label import SingleLabel
from multi_train_utils.task import MAX_CLASSES_LISTED
from multi_train_utils.train_eval_utils import MidEpochCheckpoints, agree_on_write


class RunRecorder:
    """Writes a run's files, from rank 0 (``enabled``: default, whether this process is rank
    0), as ``config`` (options.Config: its run section, --epochs, the flags) asks; what it
    writes of the best epoch and the stop, EpochDecider decided (``state.best``,
    ``state.stop_reason``).

    At the start: --output-dir made ready (``clear_earlier_run``: leftover temporary files,
    and with --overwrite the earlier run; ``set_aside_damaged_checkpoint``), then train.log
    (from then on), args.json, class_indices.json, and metrics.csv (or, resuming, the files
    of the checkpoint's epoch).

    After every epoch, in this order: ``checkpoint.pth`` (which also holds the metrics rows
    and the best epoch), then ``model-{epoch}.pth``, ``model-best.pth`` and metrics.csv, all
    of which can be rebuilt from it. A run stopped anywhere resumes from the last
    checkpoint and rewrites what came after it. Inside an epoch, ``checkpoints`` (every
    --checkpoint-every minutes, and at a preemption notice) writes ``checkpoint.pth`` alone,
    with the position in the epoch.
    """

    def __init__(self, config, data, state=None, checkpoint=None, resume_path=None, run_log=None, enabled=None,
                 world_size=None, task=None):
        self.enabled = is_main_process() if enabled is None else enabled
        self.run, self.epochs = config.run, config.recipe.epochs  # files, checkpoints, pictures; --epochs
        self.flags = config.flags  # every setting, as args.json and the checkpoint keep them
        self.task = task or SingleLabel()  # what the evaluations mean: their cells, line, best and report
        self.classes = data.classes
        self.world_size = get_world_size() if world_size is None else world_size
        # which files it trains on: a resume compares
        self.file_list = file_list_fingerprint(data) if self.enabled else None
        self.output_dir = self.run.output_dir
        checkpoint = complete_checkpoint(checkpoint) if checkpoint else {}  # read as load_checkpoint reads it
        self.rows = list(checkpoint["metrics"]) if checkpoint else []
        # The best epoch and the stop (state.best, state.stop_reason): EpochDecider's.
        self.state = state if state is not None else TrainState(None)
        self.started = time.perf_counter()
        self.drawn = []  # the pictures plot_data drew
        self.run_log = run_log
        resuming_here = resumes_in(resume_path, self.output_dir)
        # The epoch of the checkpoint.pth in --output-dir that a resumed run would start from.
        self.saved_epoch = int(checkpoint["epoch"]) if checkpoint and resuming_here else None
        # Resumed in its own folder: the same TensorBoard run, minus what lost epochs logged.
        self.log_dir = checkpoint["log_dir"] if checkpoint and resuming_here else None
        self.log_dir = self.log_dir or os.path.join(
            self.run.log_dir, f"{os.path.basename(os.path.abspath(self.output_dir))}-{time.strftime('%Y%m%d-%H%M%S')}"
                          f"-{os.getpid()}")
        self.writer = None
        self.resume_lines = []  # where a resumed run goes on: the start summary prints them
        # A weak reference back to this recorder: a cycle would keep the model (and DDP's process
        # group) alive after the run, to be torn down while the interpreter exits.
        save_inside_epoch = weakref.WeakMethod(self._save_inside_epoch)
        self.checkpoints = MidEpochCheckpoints(self.run.checkpoint_every, lambda position: save_inside_epoch()(position),
                                               hint=resume_hint(self.run), requeue=self.run.requeue)
        self.position = checkpoint["position"] if checkpoint else None  # inside the epoch of the checkpoint
        arm_notices()  # from now on SIGTERM and SIGUSR1 save, then stop
        error = None
        if self.enabled:
            try:
                self._start_files(data, checkpoint, resume_path, resuming_here)
            except Exception as e:  # noqa: BLE001 - every rank learns of it (agree_on_write), then it is raised
                error = e
        agree_on_write(error, self.state.model, f"the run's files in {self.output_dir}")

    def _start_files(self, data, checkpoint, resume_path, resuming_here):
        """Rank 0: --output-dir made ready, train.log, args.json, class_indices.json, metrics.csv
        (resuming: the files of the checkpoint's epoch), TensorBoard's writer."""
        run_log = self.run_log
        clear_earlier_run(self.run, checkpoint or None)  # leftover temporary files; with --overwrite, the earlier run
        set_aside_damaged_checkpoint(self.output_dir, resume_path)  # resumed from checkpoint-prev.pth
        os.makedirs(self.output_dir, exist_ok=True)
        if run_log is not None:  # what rank 0 printed so far, and from now on (a resumed run adds to it)
            run_log.attach(os.path.join(self.output_dir, "train.log"), append=bool(checkpoint) and resuming_here)
        write_run_settings(self.output_dir, self.flags, self.classes, images_of(data))  # args.json, class_indices.json
        if checkpoint and checkpoint["position"]:  # inside an epoch: the epoch files are those of the epoch before
            self.resume_lines = self._describe_resume(checkpoint, resume_path)
            write_metrics(self.output_dir, self.rows, metrics_header(self.task))
        elif checkpoint:
            self.resume_lines = self._describe_resume(checkpoint, resume_path)
            self._write_epoch_files(int(checkpoint["epoch"]), checkpoint["model"],
                                    (checkpoint["model_ema"] or {}).get("weights"))
        else:
            write_metrics(self.output_dir, self.rows, metrics_header(self.task))
        from torch.utils.tensorboard import SummaryWriter  # slow import: only where needed

        self.writer = SummaryWriter(log_dir=self.log_dir,
                                    purge_step=int(checkpoint["epoch"]) + 1 if checkpoint else None)

    def _describe_resume(self, checkpoint, resume_path):
        """Lines that say where a resumed run goes on (or that it is complete)."""
        epoch, world_size = int(checkpoint["epoch"]), self.world_size
        if self.state.stop_reason:
            lines = [f"resuming from {resume_path}: the run is already complete ({self.state.stop_reason}); to train "
                     "on, resume with a larger --patience, or 0"]
        elif epoch + 1 >= self.epochs:
            lines = [f"resuming from {resume_path}: the run is already complete (all {self.epochs} epochs done); "
                     "to train longer, run it again with a larger --epochs and --resume auto"]
        elif checkpoint["position"]:
            position = checkpoint["position"]
            lines = [f"resuming from {resume_path} (inside epoch {epoch + 1}: {position['done']} of its "
                     f"{position['end']} training images done): epochs {epoch + 1} to {self.epochs - 1}"]
            if position["order_world_size"] != world_size:
                lines.append(f"note: the epoch was begun by {position['order_world_size']} processes, this run has "
                             f"{world_size}: each of its remaining images is trained once, in other batches, so the "
                             "weights differ from an uninterrupted run's")
        else:
            optimizer = self.state.optimizer
            now = f", at lr {optimizer.param_groups[0]['lr']:.3g}" if optimizer is not None else ""
            lines = [f"resuming from {resume_path} (epoch {epoch} done): epochs {epoch + 1} to {self.epochs - 1}"
                     + now]
        if checkpoint["world_size"] not in (None, world_size):  # None: a checkpoint that did not say
            lines.append(f"note: the checkpoint was written by {checkpoint['world_size']} processes, this run has "
                         f"{world_size}: the learning rate is scaled anew and the data order differs")
        return lines

    def _write_epoch_files(self, epoch, weights, ema_weights=None):
        """Everything that follows from a checkpoint: model-{epoch}, model-best (the model's
        weights, the same file as model-{epoch} under a second name, or the EMA's, whichever
        scored better), metrics.csv."""
        epoch_file, best_file = (os.path.join(self.output_dir, name) for name in (f"model-{epoch}.pth", BEST_WEIGHTS))
        save_atomic(weights, epoch_file)
        if self.state.best.epoch == epoch:
            if self.state.best.source == "ema" and ema_weights is not None:
                save_atomic(ema_weights, best_file)
            else:
                link_atomic(epoch_file, best_file)  # the same bytes: not written twice
        self.task.write_best_files(self.output_dir, self.classes, self.state.best)
        write_metrics(self.output_dir, self.rows, metrics_header(self.task))
        self._prune(epoch)

    @contextlib.contextmanager
    def explain_faults(self):
        """Around the epochs: a full disk or exhausted memory becomes one line that also says
        which checkpoint is intact and how to resume."""
        try:
            yield
        except Exception as e:
            fault = e if isinstance(e, MidRunError) else resource_error(e)  # an image gone, a full disk, ...
            if fault is None and loader_failure(e):  # a loader's worker died or hangs
                fault = MidRunError(loader_failure(e))
            if fault is None:
                raise
            raise type(fault)(f"{one_line(fault)}; {self.resume_advice()}") from None

    def resume_advice(self):
        """Which checkpoint of this run is intact, and how to go on from it."""
        if self.saved_epoch is None and self.position is None:
            return "no checkpoint was written yet"
        where = (f"inside epoch {self.position['epoch']}, {self.position['done']} of {self.position['end']} images"
                 if self.position else f"epoch {self.saved_epoch}")
        return f"{os.path.join(self.output_dir, CHECKPOINT)} ({where}) is intact: continue from it with --resume auto"

    def _save_inside_epoch(self, position):
        """Rank 0: checkpoint.pth of the training state at ``position`` (an EpochPosition), alone:
        the epoch's files come at its end."""
        state = self.state
        ema_state = cpu_tensors(state.ema.state_dict()) if state.ema is not None else None
        started = time.perf_counter()
        save_checkpoint(self.output_dir, build_checkpoint(
            state, cpu_tensors(plain_state_dict(state.model)), ema_state, metrics=self.rows,
            flags=self.flags, classes=self.classes, file_list=self.file_list, world_size=self.world_size,
            log_dir=self.log_dir, position=position))
        self.position = position.to_dict()
        print(f"\ncheckpoint inside epoch {position.epoch}: step {position.step}, {position.done} of {position.end} "
              f"images ({time.perf_counter() - started:.1f} s)", flush=True)

    def end_epoch(self, epoch, train_stats, eval_result, ema_result=None, seconds=0.0, source="model"):
        """After ``epoch`` (``seconds`` long), as EpochDecider.end_epoch decided (the
        state's best epoch and stop; ``source``: whether the model or its EMA scored better):
        rank 0 saves the checkpoint, the epoch's weights, the best weights and metrics.csv;
        then every rank stops if the save failed or a preemption notice came."""
        state = self.state
        self.position = None
        error = None
        if self.enabled:
            try:
                self._save_epoch(epoch, train_stats, eval_result, ema_result, source=source, seconds=seconds)
            except Exception as e:  # noqa: BLE001 - the others must learn of it (after_epoch_save), then it is raised
                error = e
        self.checkpoints.saved()
        # every rank: rank 0's save failed, or a preemption notice came during the epoch's end: stop now
        self.checkpoints.after_epoch_save(error, state.model,
                                          notices=epoch + 1 < self.epochs and not state.stop_reason)
        self.saved_epoch = epoch  # every rank knows it now, for the advice of resume_advice

    def _save_epoch(self, epoch, train_stats, eval_result, ema_result, source, seconds):
        """Rank 0's files of ``epoch``: its metrics row, TensorBoard, checkpoint.pth, model-{epoch}.pth,
        model-best.pth, metrics.csv; then the epoch's line."""
        state = self.state
        weights = cpu_tensors(plain_state_dict(state.model))  # copied off the GPU once for the three files
        ema_state = cpu_tensors(state.ema.state_dict()) if state.ema is not None else None
        self.rows = [r for r in self.rows if int(r[0]) < epoch]
        cells = {"epoch": epoch, "train_loss": f"{train_stats.mean_loss:.6f}", "lr": f"{train_stats.last_lr:.8g}",
                 "images_per_second": f"{train_stats.images_per_second:.2f}",
                 "epoch_seconds": f"{seconds + train_stats.earlier_seconds:.3f}", "best_source": source,
                 "run_seconds": f"{state.clock.seconds():.3f}", **self.task.cells(eval_result, ema_result)}
        self.rows.append([cells.get(column, "") for column in metrics_header(self.task)])
        self._log_scalars(epoch, train_stats, eval_result, ema_result)
        save_checkpoint(self.output_dir, build_checkpoint(
            state, weights, ema_state, metrics=self.rows, flags=self.flags, classes=self.classes,
            file_list=self.file_list, world_size=self.world_size, log_dir=self.log_dir))
        self.saved_epoch = epoch
        self._write_epoch_files(epoch, weights, ema_state["weights"] if ema_state else None)
        print(epoch_line(epoch, train_stats, eval_result, ema_result, self.task), flush=True)

    def _log_scalars(self, epoch, train_stats, eval_result, ema_result):
        """The epoch's figures in TensorBoard (the EMA's under ema/)."""
        for tag, value in (("loss", train_stats.mean_loss), ("learning_rate", train_stats.last_lr),
                           ("images_per_second", train_stats.images_per_second)):
            self.writer.add_scalar(tag, value, epoch)
        for prefix, result in (("", eval_result), ("ema/", ema_result)):
            for name, value in (self.task.scalars(result) if result is not None else {}).items():
                self.writer.add_scalar(prefix + name, value, epoch)
        self.writer.flush()

    def _prune(self, epoch):
        """--keep-last K: delete per-epoch weights older than the last K (best and checkpoint stay)."""
        keep = self.run.keep_last
        if keep and keep > 0:
            for old_epoch, path in model_epoch_files(self.output_dir).items():
                if old_epoch <= epoch - keep:
                    os.remove(path)

    def plot_data(self, data, train_set, count=16):
        """class_distribution.png (for datasets with .targets) and batch_preview.png (augmented
        training images, from ``train_set``, whose items may be asked as (epoch, index)), also
        in TensorBoard (rank 0; every rank learns whether it could)."""
        error = None
        if self.enabled and self.run.plots:
            try:
                self._plot_data(data, train_set, count)
            except Exception as e:  # noqa: BLE001 - every rank learns of it (agree_on_write), then it is raised
                error = e
        agree_on_write(error, self.state.model, "the data's pictures")

    def _plot_data(self, data, train_set, count):
        train, val = class_counts(data.train, data.classes), class_counts(data.val, data.classes)
        if train is not None and val is not None:
            labels = training_labels(data.train)
            figure = (plot_label_distribution(data.classes, train, val, labels_per_image(labels))
                      if is_multi_hot(labels) else plot_class_distribution(data.classes, train, val))
            save_figure(figure, self._plot_path("class_distribution"), self.writer, "data/class_distribution")
            self.drawn.append("class_distribution")
        step = max(1, len(train_set) // count)
        samples = [train_set[(0, i)] for i in range(0, len(train_set), step)][:count]
        images, labels = zip(*samples)
        save_figure(plot_batch_preview(images, labels, self.classes), self._plot_path("batch_preview"),
                    self.writer, "data/batch_preview")
        self.drawn.append("batch_preview")

    def _plot_path(self, name):
        return os.path.join(self.output_dir, PLOT_FILES[name])

    def finish(self, decider=None):
        """After the last epoch: curves.png, the best epoch's confusion matrix (PNG and CSV),
        the end summary (with ``decider``'s time to the best epoch and to --target-accuracy);
        then TensorBoard and train.log are closed."""
        if not self.enabled:
            return
        plots = self._plot_results() if self.run.plots else []
        plots += self.task.report_best(self.state.best, self.classes, self.output_dir, writer=self.writer,
                                       step=self._last_epoch(), pictures=self.run.plots)
        clock = decider.time_to_target(self.rows, metrics_header(self.task)) if decider is not None else None
        print_end_summary(self.run, self.state, seconds=time.perf_counter() - self.started, plots=plots,
                          classes=self.classes, task=self.task, clock=clock)
        self.close()

    def _last_epoch(self):
        return int(self.rows[-1][0]) if self.rows else 0

    def _plot_results(self):
        last = self._last_epoch()
        rows = [dict(zip(metrics_header(self.task), row)) for row in self.rows]
        save_figure(plot_training_curves(rows, self.task.headline), self._plot_path("curves"), self.writer,
                    "summary/curves", last)
        return self.drawn + ["curves"]

    def close(self):
        if self.writer is not None:
            self.writer.close()
        if self.run_log is not None:
            self.run_log.close()


def epoch_line(epoch, train_stats, eval_result, ema_result=None, task=None):
    """The line printed after each epoch: loss, ``task``'s validation figures (single-label:
    accuracy with its counts and the images left out, top-5 with more than 5 classes, the
    EMA's accuracy), learning rate, speed."""
    figures = (task or SingleLabel()).epoch_text(eval_result, ema_result)
    return (f"[epoch {epoch}] train_loss: {train_stats.mean_loss:.4f}  {figures}  lr: {train_stats.last_lr:.3g}  "
            f"{train_stats.images_per_second:.1f} img/s")


# --- What each epoch's end decides: the best epoch, --patience, the time to --target-accuracy ---
# Every rank decides alike (from the same all-reduced figures). It writes nothing: the recorder
# writes what it decided.

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
    if target is not None:  # reached: the model's or the EMA's figure at the target or past it, the metric's way
        reached = [int(r["epoch"]) for r in rows
                   if any(v == v and not task.is_better(name, target, v)
                          for v in (float(r.get(f"{model}val_{name}") or "nan") for model in ("", "ema_")))]
        if not reached:
            parts.append(f"val {label} never reached --target-accuracy {target:g}")
        else:  # an epoch of an earlier version's run has no run_seconds: its time is not known
            after = f", after {format_duration(seconds[reached[0]])}" if reached[0] in seconds else ""
            parts.append(f"val {label} {target:g} first reached at epoch {reached[0]}{after}")
    return "run clock: " + "; ".join(parts) if parts else None


# --- What rank 0 prints: the start of a run (one screen), its end, and an evaluation's report ---

RULE = "-" * 78


def describe_device(device):
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({plural(torch.get_num_threads(), 'thread')})"
    return str(device)


def plural(count, word, many=None):
    """"1 worker", "2 workers" ("1 process", "2 processes" with ``many``)."""
    return f"{count} {word if count == 1 else many or word + 's'}"


def print_start_summary(config, data, state, settings, device, workers=0, log_dir="-", resumed=()):
    """Devices, data, model (``state.model``), batch, the learning-rate schedule (as the run
    was started, also when it resumes), where everything goes, then the ``resumed`` lines (where
    a resumed run goes on), of ``config`` (options.Config); rank 0 prints it."""
    if not is_main_process():
        return
    recipe, speed, run = config.recipe, config.speed, config.run
    world_size, job = get_world_size(), current_job()
    launcher = "single process" if job is None else job.launcher
    backend = dist.get_backend() if is_dist_avail_and_initialized() else "-"
    group = state.optimizer.param_groups[0]
    model, lr = state.model, group.get("initial_lr", group["lr"])  # the schedule's start, not where it stands
    print(RULE)
    if world_size > 1 and device.type == "cuda":
        where = f"one GPU per process ({torch.cuda.get_device_name(device)})"
    else:
        where = describe_device(device) + (" per process" if world_size > 1 else "")
    print(f"world size: {world_size} ({launcher}, backend {backend}), device: {where}")
    print(f"amp: {settings.precision.describe()}, channels_last: {'on' if settings.channels_last else 'off'}"
          + (", compiled" if speed.compile else "") + (", grad-checkpoint" if speed.grad_checkpoint else ""))
    print_data_summary(config, data, settings.task)
    trainable = count_parameters(model, trainable_only=True)
    total = count_parameters(model)
    print(f"model: {recipe.model} ({total:,} parameters"
          + (f", {trainable:,} trainable" if trainable != total else "") + ")")
    print(f"batch: {recipe.batch_size} per process x {plural(speed.accum_steps, 'accumulation step')} x "
          f"{plural(world_size, 'process', 'processes')} = "
          f"{recipe.batch_size * speed.accum_steps * world_size} per optimizer step; {plural(workers, 'loader worker')} "
          f"per process; {describe_decoders(data)}" + images_left_out(len(data.train), recipe.batch_size, world_size))
    scaled = f" ({recipe.lr:g} x {world_size} processes)" if lr != recipe.lr else ""
    warmup = f"{recipe.warmup_epochs} warm-up epochs, then " if recipe.warmup_epochs else ""
    schedule = (f"x {recipe.lr_gamma:g} every {recipe.lr_step_size} epochs" if recipe.lr_scheduler == "step" else
                f"cosine to {lr * recipe.lrf:g} at epoch {recipe.epochs - 1}")
    print(f"lr: {lr:g}{scaled}; {warmup}{schedule}")
    print("recipe: " + describe_recipe(config))
    print(f"outputs: {run.output_dir} (train.log, metrics.csv, model-best.pth, checkpoint.pth, plots)")
    print(f"TensorBoard: {log_dir}; view with: tensorboard --logdir {run.log_dir}")
    for line in resumed:
        print(line)
    print(RULE, flush=True)


def images_left_out(train_images, batch_size, world_size):
    """"; N of M training images an epoch (...)" where each process's last partial batch
    leaves images out (each process takes ceil(M / world size) of the shuffled order, in whole
    batches: loaders.EpochBatchSampler); "" where none are."""
    trained = math.ceil(train_images / world_size) // batch_size * batch_size * world_size
    if trained >= train_images:
        return ""
    return (f"; {trained} of {train_images} training images an epoch (each process's last partial batch is left "
            "out, other images each epoch)")


SAMPLED_FILES = 10_000  # the image files whose names describe_decoders reads (evenly spread)


def describe_decoders(data):
    """Which decoder reads the formats present among the training files (their endings, from
    up to SAMPLED_FILES of them): JPEGs TorchCodec where installed (RGB data), the rest PIL."""
    paths = getattr(data.train, "images_path", None)
    if paths is None:
        return "images read by your dataset"
    if getattr(data.train, "channels", 3) != 3:  # gray and RGBA files are read through PIL's modes
        return "images decoded by PIL"
    step = max(1, len(paths) // SAMPLED_FILES)
    endings = {os.path.splitext(paths[i])[1].lower() for i in range(0, len(paths), step)}
    jpeg = bool(endings & {".jpg", ".jpeg"})
    others = sorted(e.lstrip(".").upper() for e in endings - {".jpg", ".jpeg"})
    parts = ([f"JPEG decoded by {JPEG_DECODER}"] if jpeg else []) + ([f"{', '.join(others)} by PIL"] if others else [])
    return "; ".join(parts) or "images decoded by PIL"


def describe_recipe(config):
    """One line: optimizer, augmentation, loss, sampling, EMA (``config.recipe``), best metric
    and patience (``config.run``)."""
    recipe, run = config.recipe, config.run
    decay = "" if recipe.norm_bias_decay else ", none on norm and bias"
    parts = [f"{recipe.opt} (weight decay {recipe.weight_decay:g}{decay})"]
    augment = ["crop"] + ([f"flip {recipe.hflip:g}"] if recipe.hflip else [])
    augment += [recipe.auto_augment] if recipe.auto_augment != "none" else []
    augment += [f"erase {recipe.random_erase:g}"] if recipe.random_erase else []
    augment += [f"mixup {recipe.mixup_alpha:g}"] if recipe.mixup_alpha else []
    augment += [f"cutmix {recipe.cutmix_alpha:g}"] if recipe.cutmix_alpha else []
    parts.append("augment " + " + ".join(augment))
    if recipe.label_smoothing:
        parts.append(f"label smoothing {recipe.label_smoothing:g}")
    if recipe.class_weights != "none":
        parts.append(f"{recipe.class_weights} class weights")
    parts.append(f"{recipe.sampler} sampler")
    if recipe.model_ema:
        parts.append(f"EMA (decay {recipe.model_ema_decay:g})")
    parts.append(f"best by val {run.best_metric}" + (f", patience {run.patience}" if run.patience else ""))
    return "; ".join(parts)


def format_duration(seconds):
    minutes, seconds = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def print_end_summary(run, state, seconds, plots=(), classes=(), task=None, clock=None):
    """Best --best-metric (of ``run``, the flags' run section) and its epoch (``state.best``),
    whose weights model-best.pth holds (the model's or its EMA's), why the run stopped early if
    it did, the time taken (``seconds``), the run's ``clock`` (EpochDecider's
    time_to_target), and where the weights and ``plots`` are; what ``task`` says of the best
    epoch (of ``classes``; multi-label: its per-class figures and thresholds)."""
    task = task or SingleLabel()
    output_dir, epoch = run.output_dir, state.best.epoch
    best = os.path.join(output_dir, "model-best.pth")
    print(RULE)
    if state.stop_reason:
        print(state.stop_reason)
    print(f"best val {run.best_metric.replace('_', ' ')}: {state.best.value:.4f} at epoch {epoch}; this session took "
          f"{format_duration(seconds)}")
    if clock:
        print(clock)
    source = "the EMA of the weights (--model-ema)" if state.best.source == "ema" else "the model's weights"
    print(f"best weights: {best} ({source}, epoch {epoch})")
    task.print_best(state.best, classes, output_dir)
    if plots:
        print("plots: " + ", ".join(os.path.join(output_dir, PLOT_FILES[p]) for p in plots))
    print(f"predict: python predict.py --weights {best} --image PATH")
    size, files = folder_bytes(output_dir)
    epoch_file = os.path.join(output_dir, f"model-{epoch}.pth")
    shared = os.path.isfile(epoch_file) and os.path.isfile(best) and os.path.samefile(best, epoch_file)
    print(f"disk: {output_dir} holds {format_bytes(size)} in {plural(files, 'file')}"
          + (f" (model-best.pth is model-{epoch}.pth, one file under two names)" if shared else ""))
    print(RULE, flush=True)


def print_data_summary(config, data, task=None):
    """Rank 0's description of the data: images per class and split sizes, skipped files;
    an imbalance warning names the flags that help ``task`` (``config``: options.Config)."""
    flags = config.data
    if not flags.demo and not flags.train_list and os.path.exists(os.path.join(flags.data_path, DEMO_MARKER)):
        print(f"note: {flags.data_path} holds generated demo images (written by --demo), not real photos")
    reasons = getattr(data, "skip_reasons", None) or {}
    for path in data.skipped:
        print(f"warning: skipping {path}: {reasons.get(path, 'not a readable image')}", flush=True)
    for note in getattr(data, "notes", ()):
        print(f"warning: {note}", flush=True)
    if flags.train_list:
        where = flags.train_list + (f" + {flags.val_list} (validation)" if flags.val_list else "")
    else:
        where = f"{flags.data_path}" + (f" + {flags.val_path} (validation)" if flags.val_path else "")
    train, val = class_counts(data.train, data.classes), class_counts(data.val, data.classes)
    labels = training_labels(data.train)
    if labels is not None and is_multi_hot(labels):
        per_image = labels_per_image(labels)
        print(f"labels: {per_image.mean():.2f} per training image on average, at most {per_image.max()}; "
              f"{plural(int((per_image == 0).sum()), 'training image')} with none (counts below: images with the class)")
    if train is not None and val is not None and len(data.classes) > MAX_CLASSES_LISTED:
        counts, balance = describe_many_classes(data.classes, [t + v for t, v in zip(train, val)])
        print(f"data: {where}: {counts}\n{balance}")
    elif train is not None and val is not None:
        print(f"data: {where}: " + ", ".join(f"{t + v} {c}" for c, t, v in zip(data.classes, train, val)))
    else:
        print(f"data: {where}: {len(data.classes)} classes (images per class: give the datasets .targets)")
    print(f"split: {len(data.train)} train, {len(data.val)} val images", flush=True)
    remedy = (task or SingleLabel()).balance_flags
    warning = imbalance_warning(config.recipe, train, data.classes, remedy) if train is not None else None
    if warning:
        print(f"warning: {warning}", flush=True)
    print(describe_images(*images_info(data)))


def describe_images(channels, mean, std):
    """The line on what the model is given: the images' channels and what normalises them."""
    if mean is None:
        return f"images: {plural(channels, 'channel')}, pixel values in [0, 1], not normalised"
    return (f"images: {plural(channels, 'channel')}, normalised by mean ({', '.join(f'{m:.3g}' for m in mean)}) "
            f"and std ({', '.join(f'{v:.3g}' for v in std)})")


def describe_many_classes(classes, counts, shown=3):
    """Two lines on the images per class of a dataset with many classes: how many classes and
    images, the ``shown`` smallest and largest classes, the median; and how imbalanced."""
    order = sorted(range(len(classes)), key=lambda c: (counts[c], c))
    biggest = sorted(range(len(classes)), key=lambda c: (-counts[c], c))  # ties in label order, as for the smallest
    named = [", ".join(f"{classes[c]} ({counts[c]})" for c in picked) for picked in (order[:shown], biggest[:shown])]
    median = sorted(counts)[len(counts) // 2]
    smallest, largest = counts[order[0]], counts[biggest[0]]
    if smallest == largest:
        balance = f"every class has {largest} images"
    elif smallest == 0:
        balance = f"{sum(1 for n in counts if n == 0)} class(es) have no images"
    else:
        balance = (f"the largest class has {largest / smallest:.1f}x the images of the smallest; "
                   f"{sum(1 for n in counts if n < median / 2)} class(es) have less than half the median")
    return [f"{len(classes)} classes, {sum(counts)} images; smallest {named[0]}; largest {named[1]}; "
            f"median {median} images a class", f"imbalance: {balance}"]


def class_counts(dataset, classes):
    """Images per class from ``dataset.targets`` (multi-label: the images that carry each
    class), or None if the dataset has none."""
    labels = training_labels(dataset)
    if labels is None:
        return None
    return positives_per_class(labels) if is_multi_hot(labels) else label_counts(labels, len(classes))


def report_evaluation(evaluation, data, config, task=None):
    """What --eval-only prints and writes, in the order it happens: rank 0 describes the data,
    every rank runs ``evaluation`` (a call of evaluate, whose collectives need them all), then
    rank 0 prints ``task``'s per-class and overall metrics and, with --eval-output, writes them
    (single-label: the confusion matrix as PNG and CSV, overall_metrics.csv,
    per_class_metrics.csv); ``config``: options.Config. The other ranks print and write nothing."""
    task = task or SingleLabel()
    if is_main_process():
        print_data_summary(config, data, task)
    result = evaluation()
    if not is_main_process():
        return
    task.print_evaluation(result, data.classes)
    if config.run.eval_output:
        task.write_evaluation(result, data.classes, config.run.eval_output, printable(config.recipe.weights))

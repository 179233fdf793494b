"""What rank 0 writes while training: checkpoint, weights, metrics.csv, args.json, TensorBoard."""
import contextlib
import os
import time
import weakref

from multi_train_utils.checkpoint import (CHECKPOINT, TrainState, build_checkpoint, complete_checkpoint, resumes_in,
                                          save_checkpoint, set_aside_damaged_checkpoint)
from multi_train_utils.errors import MidRunError, loader_failure, one_line, resource_error
from multi_train_utils.balance import is_multi_hot, labels_per_image, training_labels
from multi_train_utils.files import cpu_tensors, link_atomic, save_atomic
from multi_train_utils.pictures import (PLOT_FILES, plot_batch_preview, plot_class_distribution, plot_label_distribution,
                                        plot_training_curves, save_figure)
from multi_train_utils.inputs import file_list_fingerprint, resume_hint
from multi_train_utils.mid_epoch import MidEpochCheckpoints, agree_on_write
from multi_train_utils.model_setup import plain_state_dict
from multi_train_utils.process import get_world_size, is_main_process
from multi_train_utils.run_files import (BEST_WEIGHTS, clear_earlier_run, images_of,
                                         metrics_header, model_epoch_files, write_metrics,
                                         write_run_settings)
from multi_train_utils.single_label import SingleLabel
from multi_train_utils.signals import arm_notices
from multi_train_utils.summary import class_counts, print_end_summary


class RunRecorder:
    """Writes a run's files, from rank 0 (``enabled``: default, whether this process is rank
    0), as ``config`` (options.Config: its run section, --epochs, the flags) asks; what it
    writes of the best epoch and the stop, decider.EpochDecider decided (``state.best``,
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
        # The best epoch and the stop (state.best, state.stop_reason): decider.EpochDecider's.
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
        """After ``epoch`` (``seconds`` long), as decider.EpochDecider.end_epoch decided (the
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

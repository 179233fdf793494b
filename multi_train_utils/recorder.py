"""What rank 0 writes while training: the checkpoint, weights, metrics.csv, args.json,
TensorBoard."""
import os
import time

from model import plain_state_dict
from multi_train_utils.checkpoint import (CHECKPOINT, PREVIOUS_CHECKPOINT, clear_earlier_run,
                                          clear_leftover_temporary_files, model_epoch_files, resumes_in, rng_state,
                                          save_atomic, save_checkpoint, write_json_atomic, write_text_atomic)
from multi_train_utils.options import args_to_dict
from utils import write_class_indices

METRICS_HEADER = ["epoch", "train_loss", "val_accuracy", "lr", "images_per_second", "epoch_seconds"]


class RunRecorder:
    """Writes a run's files; does nothing on ranks other than 0 (``enabled=False``).

    After every epoch, in this order: ``checkpoint.pth`` (which also holds the metrics rows
    and the best epoch), then ``model-{epoch}.pth``, ``model-best.pth`` and metrics.csv, all
    of which can be rebuilt from it. A run stopped anywhere resumes from the last
    checkpoint and rewrites what came after it.
    """

    def __init__(self, args, classes, enabled=True, checkpoint=None, resume_path=None):
        self.enabled = enabled
        self.args = args
        self.classes = classes
        self.output_dir = args.output_dir
        checkpoint = checkpoint or {}
        self.rows = list(checkpoint.get("metrics", []))
        self.best_accuracy = checkpoint.get("best_accuracy", -1.0)
        self.best_epoch = checkpoint.get("best_epoch", -1)
        resuming_here = resumes_in(resume_path, self.output_dir)
        # Resumed in its own folder: the same TensorBoard run, minus what lost epochs logged.
        self.log_dir = checkpoint.get("log_dir") if resuming_here else None
        self.log_dir = self.log_dir or os.path.join(
            args.log_dir, f"{os.path.basename(os.path.abspath(args.output_dir))}-{time.strftime('%Y%m%d-%H%M%S')}"
                          f"-{os.getpid()}")
        self.writer = None
        if not enabled:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        clear_leftover_temporary_files(self.output_dir)
        if not checkpoint and (args.overwrite or args.resume == "auto"):
            clear_earlier_run(self.output_dir)  # --resume auto with nothing to resume: a fresh start
        if resume_path and resume_path.endswith(PREVIOUS_CHECKPOINT) and resuming_here:
            damaged = os.path.join(self.output_dir, CHECKPOINT)
            if os.path.exists(damaged):  # keep it out of the way: it must never become "previous"
                os.replace(damaged, damaged + ".damaged")
        write_json_atomic(args_to_dict(args), os.path.join(self.output_dir, "args.json"))
        write_class_indices(classes, self.output_dir)
        if checkpoint:
            self._report_resume(checkpoint, resume_path)
            self._write_epoch_files(int(checkpoint["epoch"]), checkpoint["model"])
        else:
            self._write_metrics()
        from torch.utils.tensorboard import SummaryWriter  # slow import: only where needed

        self.writer = SummaryWriter(log_dir=self.log_dir,
                                    purge_step=int(checkpoint["epoch"]) + 1 if checkpoint else None)

    def _report_resume(self, checkpoint, resume_path):
        epoch, world_size = int(checkpoint["epoch"]), getattr(self.args, "world_size", 1)
        print(f"resuming from {resume_path} (epoch {epoch} done): epochs {epoch + 1} to {self.args.epochs - 1}",
              flush=True)
        if checkpoint.get("world_size", world_size) != world_size:
            print(f"note: the checkpoint was written by {checkpoint['world_size']} processes, this run has "
                  f"{world_size}: the learning rate is scaled anew and the data order differs", flush=True)

    def _write_metrics(self):
        lines = [",".join(METRICS_HEADER)] + [",".join(str(v) for v in row) for row in self.rows]
        write_text_atomic("\n".join(lines) + "\n", os.path.join(self.output_dir, "metrics.csv"))

    def _write_epoch_files(self, epoch, weights):
        """Everything that follows from a checkpoint: model-{epoch}, model-best, metrics.csv."""
        save_atomic(weights, os.path.join(self.output_dir, f"model-{epoch}.pth"))
        if self.best_epoch == epoch:
            save_atomic(weights, os.path.join(self.output_dir, "model-best.pth"))
        self._write_metrics()
        self._prune(epoch)

    def end_epoch(self, epoch, model, optimizer, lr_scheduler, scaler, train_stats, eval_result, epoch_seconds):
        """Save the checkpoint, then the epoch's weights, the best weights and metrics.csv."""
        if not self.enabled:
            return
        weights = plain_state_dict(model)
        if eval_result.accuracy > self.best_accuracy:
            self.best_accuracy, self.best_epoch = eval_result.accuracy, epoch
        images_per_second = train_stats.images_per_second  # training only, warm-up left out
        self.rows = [r for r in self.rows if int(r[0]) < epoch]
        self.rows.append([epoch, f"{train_stats.mean_loss:.6f}", f"{eval_result.accuracy:.6f}",
                          f"{train_stats.last_lr:.8g}", f"{images_per_second:.2f}", f"{epoch_seconds:.3f}"])
        for tag, value in (("loss", train_stats.mean_loss), ("accuracy", eval_result.accuracy),
                           ("learning_rate", train_stats.last_lr), ("images_per_second", images_per_second)):
            self.writer.add_scalar(tag, value, epoch)
        self.writer.flush()
        save_checkpoint(self.output_dir, {
            "model": weights,
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
            "epoch": epoch,
            "best_accuracy": self.best_accuracy,
            "best_epoch": self.best_epoch,
            "metrics": self.rows,
            "args": args_to_dict(self.args),
            "classes": list(self.classes),
            "world_size": getattr(self.args, "world_size", 1),
            "log_dir": self.log_dir,
            "rng": rng_state(),
        })
        self._write_epoch_files(epoch, weights)
        print(f"[epoch {epoch}] train_loss: {train_stats.mean_loss:.4f}  val_accuracy: {eval_result.accuracy:.4f} "
              f"({eval_result.correct}/{eval_result.total})  lr: {train_stats.last_lr:.3g}  "
              f"{images_per_second:.1f} img/s", flush=True)

    def _prune(self, epoch):
        """--keep-last K: delete per-epoch weights older than the last K (best and checkpoint stay)."""
        keep = self.args.keep_last
        if keep and keep > 0:
            for old_epoch, path in model_epoch_files(self.output_dir).items():
                if old_epoch <= epoch - keep:
                    os.remove(path)

    def close(self):
        if self.writer is not None:
            self.writer.close()

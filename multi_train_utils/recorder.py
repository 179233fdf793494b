"""What rank 0 writes while training: weights, the checkpoint, metrics.csv, args.json,
TensorBoard."""
import csv
import os
import time

from model import plain_state_dict
from multi_train_utils.checkpoint import (clear_earlier_run, model_epoch_files, rng_state, save_atomic,
                                          save_checkpoint, write_json_atomic, write_text_atomic)
from multi_train_utils.options import args_to_dict
from utils import write_class_indices

METRICS_HEADER = ["epoch", "train_loss", "val_accuracy", "lr", "images_per_second", "epoch_seconds"]


class RunRecorder:
    """Writes a run's files; does nothing on ranks other than 0 (``enabled=False``).

    After every epoch, in this order: ``model-{epoch}.pth``, ``model-best.pth`` when the
    accuracy is the best so far, the metrics.csv row, then ``checkpoint.pth``. A run stopped
    anywhere in between resumes from the previous checkpoint, whose epoch is then trained
    again and its metrics row replaced.
    """

    def __init__(self, args, classes, enabled=True, checkpoint=None):
        self.enabled = enabled
        self.args = args
        self.classes = classes
        self.output_dir = args.output_dir
        self.best_accuracy = checkpoint.get("best_accuracy", -1.0) if checkpoint else -1.0
        self.best_epoch = checkpoint.get("best_epoch", -1) if checkpoint else -1
        self.log_dir = (checkpoint or {}).get("log_dir") or os.path.join(
            args.log_dir, f"{os.path.basename(os.path.abspath(args.output_dir))}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        self.writer = None
        if not enabled:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        if checkpoint is None and (args.overwrite or args.resume == "auto"):
            clear_earlier_run(self.output_dir)  # --resume auto with nothing to resume: a fresh start
        write_json_atomic(args_to_dict(args), os.path.join(self.output_dir, "args.json"))
        write_class_indices(classes, self.output_dir)
        start_epoch = int(checkpoint["epoch"]) + 1 if checkpoint else 0
        self._cut_metrics(start_epoch)
        from torch.utils.tensorboard import SummaryWriter  # slow import: only where needed

        # On resume: the same TensorBoard run, minus what the lost epochs had logged.
        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=start_epoch if checkpoint else None)

    @property
    def metrics_path(self):
        return os.path.join(self.output_dir, "metrics.csv")

    def _cut_metrics(self, start_epoch):
        """Keep the header and the rows of epochs before ``start_epoch``."""
        rows = []
        if start_epoch > 0 and os.path.exists(self.metrics_path):
            with open(self.metrics_path, newline="") as f:
                rows = [r for r in csv.reader(f)][1:]
            rows = [r for r in rows if r and r[0].isdigit() and int(r[0]) < start_epoch]
        lines = [",".join(METRICS_HEADER)] + [",".join(r) for r in rows]
        write_text_atomic("\n".join(lines) + "\n", self.metrics_path)

    def end_epoch(self, epoch, model, optimizer, lr_scheduler, train_stats, eval_result, epoch_seconds):
        """Save the epoch's weights, the best weights, its metrics row and the checkpoint."""
        if not self.enabled:
            return
        weights = plain_state_dict(model)
        save_atomic(weights, os.path.join(self.output_dir, f"model-{epoch}.pth"))
        if eval_result.accuracy > self.best_accuracy:
            self.best_accuracy, self.best_epoch = eval_result.accuracy, epoch
            save_atomic(weights, os.path.join(self.output_dir, "model-best.pth"))
        images_per_second = train_stats.images / max(epoch_seconds, 1e-9)
        row = [epoch, f"{train_stats.mean_loss:.6f}", f"{eval_result.accuracy:.6f}", f"{train_stats.last_lr:.8g}",
               f"{images_per_second:.2f}", f"{epoch_seconds:.3f}"]
        with open(self.metrics_path, "a", newline="") as f:
            csv.writer(f).writerow(row)
            f.flush()
            os.fsync(f.fileno())
        save_checkpoint(self.output_dir, {
            "model": weights,
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict(),
            "scaler": None,
            "epoch": epoch,
            "best_accuracy": self.best_accuracy,
            "best_epoch": self.best_epoch,
            "args": args_to_dict(self.args),
            "classes": list(self.classes),
            "world_size": getattr(self.args, "world_size", 1),
            "log_dir": self.log_dir,
            "rng": rng_state(),
        })
        self._prune(epoch)
        self.writer.add_scalar("loss", train_stats.mean_loss, epoch)
        self.writer.add_scalar("accuracy", eval_result.accuracy, epoch)
        self.writer.add_scalar("learning_rate", train_stats.last_lr, epoch)
        self.writer.add_scalar("images_per_second", images_per_second, epoch)
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

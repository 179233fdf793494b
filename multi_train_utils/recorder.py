"""What rank 0 writes while training: weights, metrics.csv, args.json, TensorBoard."""
import csv
import os
import time

from model import plain_state_dict
from multi_train_utils.checkpoint import clear_earlier_run, save_atomic, write_json_atomic
from multi_train_utils.options import args_to_dict
from utils import write_class_indices

METRICS_HEADER = ["epoch", "train_loss", "val_accuracy", "lr", "images_per_second", "epoch_seconds"]


class RunRecorder:
    """Writes a run's files; does nothing on ranks other than 0 (``enabled=False``)."""

    def __init__(self, args, classes, enabled=True):
        self.enabled = enabled
        self.output_dir = args.output_dir
        self.writer = None
        self.log_dir = os.path.join(
            args.log_dir, f"{os.path.basename(os.path.abspath(args.output_dir))}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        if not enabled:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        if args.overwrite:
            clear_earlier_run(self.output_dir)
        write_json_atomic(args_to_dict(args), os.path.join(self.output_dir, "args.json"))
        write_class_indices(classes, self.output_dir)
        with open(self.metrics_path, "w", newline="") as f:
            csv.writer(f).writerow(METRICS_HEADER)
        from torch.utils.tensorboard import SummaryWriter  # slow import: only where needed

        self.writer = SummaryWriter(log_dir=self.log_dir)

    @property
    def metrics_path(self):
        return os.path.join(self.output_dir, "metrics.csv")

    def end_epoch(self, epoch, model, train_stats, eval_result, epoch_seconds):
        """Save ``model-{epoch}.pth`` and append the epoch's row to metrics.csv and TensorBoard."""
        if not self.enabled:
            return
        save_atomic(plain_state_dict(model), os.path.join(self.output_dir, f"model-{epoch}.pth"))
        images_per_second = train_stats.images / max(epoch_seconds, 1e-9)
        row = [epoch, f"{train_stats.mean_loss:.6f}", f"{eval_result.accuracy:.6f}", f"{train_stats.last_lr:.8g}",
               f"{images_per_second:.2f}", f"{epoch_seconds:.3f}"]
        with open(self.metrics_path, "a", newline="") as f:
            csv.writer(f).writerow(row)
            f.flush()
            os.fsync(f.fileno())
        self.writer.add_scalar("loss", train_stats.mean_loss, epoch)
        self.writer.add_scalar("accuracy", eval_result.accuracy, epoch)
        self.writer.add_scalar("learning_rate", train_stats.last_lr, epoch)
        self.writer.add_scalar("images_per_second", images_per_second, epoch)
        print(f"[epoch {epoch}] train_loss: {train_stats.mean_loss:.4f}  val_accuracy: {eval_result.accuracy:.4f} "
              f"({eval_result.correct}/{eval_result.total})  lr: {train_stats.last_lr:.3g}  "
              f"{images_per_second:.1f} img/s", flush=True)

    def close(self):
        if self.writer is not None:
            self.writer.close()

"""Test helper: run a training script's main() with probes patched in.

    python tests/helpers/probe.py single|multi [script flags...]

Environment:
  PROBE_OUT       prefix of the JSON file each rank writes (PREFIX.rank{R}.json): its exit code
                  (exit_code: run_cli's, or the stop watchdog's os._exit; none if killed), the
                  parameter checksum before and after the DDP wrap, the sample indices
                  this rank trains on in each epoch (all of it, or after a resume the rest), the dtype and memory format of the
                  first convolution's output in training, the checksum of the buffers
                  (BatchNorm statistics) each evaluation used, a hash of all the weights
                  each evaluation used (the model's, and the EMA's with --model-ema), the training steps run,
                  the training loss's label smoothing and class weights and whether its targets were soft,
                  whether the trained model has SyncBatchNorm, the device of its weights, and the
                  training loader's workers and torch's threads in the first epoch
  PROBE_PERTURB   "1": add noise to the weights of ranks other than 0 before the DDP wrap,
                  so that identical weights afterwards prove DDP's broadcast
  PROBE_BN_EVAL   "1": keep every BatchNorm in eval mode while training (batch-size
                  independent model, for the equivalence test)
  PROBE_FLOAT64   "1": model and inputs in float64 (the equivalence tests' exact mode)
  PROBE_SKEW_BN   "1": ranks other than 0 reset their BatchNorm statistics after each
                  training epoch (what evaluation must not see)
  PROBE_NAN_RANK  R: the loss value of rank R becomes NaN at its step PROBE_NAN_STEP
                  (default 0); its gradients stay finite, so nothing reaches other ranks.
                  Lists ("0,1" and "2,1") give each of those ranks its own step
  PROBE_RAISE_RANK R: rank R raises an exception at its first training step (before its
                  loader starts), or with PROBE_RAISE_STEP N in the forward of its step N
  PROBE_HANG_RANK R: rank R stops responding at its first training step, until SIGTERM or SIGUSR1
                  (then it exits at once, rather than after torchrun's 30 s)
  PROBE_STUCK_DESTROY "1": destroying the process group never returns (as NCCL's can when a
                  peer is gone); the clean-up's bound becomes 2 s
  PROBE_COUNT_SYNCS "1": count DDP's gradient all-reduces (bucket by bucket) into the JSON
  PROBE_STEP_SLEEP seconds to sleep in every training step (to stop a run mid-way)
  PROBE_GC_OFF    "1": the cyclic garbage collector never runs by itself (as in a run that
                  ends before it does): record how many DDP models are left when main()
                  returns ("ddp_after_main") and when run_cli is done ("ddp_at_exit")
  PROBE_SIGNAL    "NAME:STEP:TO[:RANK]": when training step STEP (counted over the process's
                  life, from 0) begins, send signal NAME (SIGTERM, SIGUSR1, SIGKILL...) to
                  TO: "launcher" (this process's parent, e.g. torchrun, from rank 0) or "self"
                  (every rank, or only rank RANK); only in torchrun's first attempt
  PROBE_SIGNAL_IN_SAVE NAME: send signal NAME to this process while it writes a checkpoint
                  inside an epoch, after the file's first bytes
  PROBE_STOP      "NAME:POINT:WHO": the fault matrix's stops. POINT: "startup" (as the model is
                  built), "step-E-S" (as step S of epoch E begins, S counted in the whole epoch,
                  also after a resume inside it), "validation-E" (as epoch E's validation
                  begins), "epoch_save-E" (while epoch E's checkpoint is written, after its
                  first bytes), "inside_save" (likewise, in this process's first save inside
                  an epoch), "run_files" (as rank 0 writes args.json at the start). WHO:
                  "self" (every rank signals itself), "launcher" (rank 0
                  signals its parent), or "rank0" / "rank1" (that rank alone signals itself);
                  only in torchrun's first attempt.
                  NAME "ENOSPC": the point raises the OSError of a full disk instead
  PROBE_REFUSE_DATA_RANK R: rank R refuses the data with a UserError: rank 0 inside the listing
                  that it broadcasts (file_list.listed_once), another rank after it
  PROBE_LOADER_TIMEOUT seconds a loader waits for a worker's batch (loaders.WORKER_TIMEOUT_SECONDS)
  PROBE_VAL_WORKER "hang:R", "die:R" or "kill:R": on rank R, the validation loader's worker
                  hangs (sleeps an hour), exits (os._exit) or is killed (SIGKILL) at its first image
  PROBE_REMOVE_AT_EPOCH "E:PATH": delete the file PATH as epoch E begins (a data file that
                  vanishes while the run uses it)
  PROBE_FILE_LISTS "1": record the paths and labels of both datasets, the types that hold
                  them, and how many class folders this rank listed itself
  PROBE_WRITES    "1": record the files this process (not its loader workers) opens for writing,
                  renames into place or removes: "writes", sorted (an audit hook sees them all,
                  whichever library writes; torch.save's own writer is seen by its os.replace)
Probes live here, not in the product's flags.
"""
import importlib
import json
import os
import signal
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import multi_train_utils.model_setup as model_setup  # noqa: E402
import multi_train_utils.train_eval_utils as train_eval_utils  # noqa: E402
from multi_train_utils.errors import run_cli  # noqa: E402
from multi_train_utils.multi_label import MultiLabelLoss  # noqa: E402

if os.environ.get("PROBE_FLOAT64") == "1":
    torch.set_default_dtype(torch.float64)  # torchvision's models and the normaliser's constants

target = importlib.import_module({"single": "train_single", "multi": "train_multi_gpu"}[sys.argv[1]])
rank = int(os.environ.get("RANK", "0"))
record = {"rank": rank, "orders": {}, "eval_buffers": [], "eval_hashes": [], "steps": 0}


def checksum(model):
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


def buffer_checksum(model):
    return float(sum(b.detach().double().abs().sum() for b in model.buffers() if b.is_floating_point()))


def weights_hash(model):
    """SHA-256 of every parameter and buffer, in state_dict order: equal hashes, equal bytes."""
    import hashlib

    digest = hashlib.sha256()
    for value in model_setup.unwrap_model(model).state_dict().values():
        digest.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def record_first_conv_output(model):
    """The dtype and memory format of the first convolution's output in the first training step."""
    conv = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    if conv is None:
        return

    def hook(module, inputs, output):
        if module.training and "conv_dtype" not in record:
            record["conv_dtype"] = str(output.dtype).removeprefix("torch.")
            record["conv_channels_last"] = output.is_contiguous(memory_format=torch.channels_last)

    conv.register_forward_hook(hook)


real_build_model = target.build_model
real_build_datasets = target.build_datasets


def build_datasets(args):
    """build_datasets, with what it listed and returned recorded (PROBE_FILE_LISTS)."""
    import multi_train_utils.datasets as data_split

    real_scan, listed = data_split._scan_class_folders, []

    def counting_scan(root, classes, *more, **kwargs):
        listed.append(len(classes))
        return real_scan(root, classes, *more, **kwargs)

    data_split._scan_class_folders = counting_scan
    try:
        data = real_build_datasets(args)
    finally:
        data_split._scan_class_folders = real_scan
    record["class_folders_listed"] = sum(listed)
    record["holders"] = [type(data.train.images_path).__name__, type(data.train.images_class).__name__]
    for name, dataset in (("train", data.train), ("val", data.val)):
        record[name] = list(dataset.images_path)
        record[name + "_labels"] = [int(y) for y in dataset.images_class]
    return data


if os.environ.get("PROBE_FILE_LISTS") == "1":
    target.build_datasets = build_datasets


def build_model(*args, **kwargs):
    model = real_build_model(*args, **kwargs)
    if os.environ.get("PROBE_PERTURB") == "1" and rank != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)  # small: rank 1 alone must still train
    record["before_wrap"] = checksum(model)
    record_first_conv_output(model)
    return model


real_train_one_epoch = target.train_one_epoch


def train_one_epoch(state, data_loader, device, epoch, *args, **kwargs):
    model = state.model
    if os.environ.get("PROBE_RAISE_RANK") == str(rank) and not os.environ.get("PROBE_RAISE_STEP"):
        raise RuntimeError(f"probe: rank {rank} fails")
    if os.environ.get("PROBE_HANG_RANK") == str(rank):
        from multi_train_utils.errors import notice_received

        while notice_received() is None:  # hangs until a signal (torchrun's SIGTERM once another rank failed)
            time.sleep(0.1)
        os._exit(128 + notice_received())
    stop["epoch"] = epoch
    if epoch == 0:
        record["after_wrap"] = checksum(model)
        record["sync_bn"] = any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
        record["device"] = str(next(model.parameters()).device)
        record["loader_workers"], record["threads"] = data_loader.num_workers, torch.get_num_threads()
    remove_epoch, _, remove_path = os.environ.get("PROBE_REMOVE_AT_EPOCH", "").partition(":")
    if remove_path and epoch == int(remove_epoch) and rank == 0:
        os.remove(remove_path)
    try:
        stats = real_train_one_epoch(state, data_loader, device, epoch, *args, **kwargs)
    finally:  # the batches of the epoch as trained (a resumed epoch: what remained of it)
        record["orders"][epoch] = [index for batch in data_loader.batch_sampler for (_, index) in batch]
    if os.environ.get("PROBE_SKEW_BN") == "1" and rank != 0:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.reset_running_stats()
    return stats


real_evaluate = target.evaluate


def evaluate(model, *args, **kwargs):
    result = real_evaluate(model, *args, **kwargs)
    record["eval_buffers"].append(buffer_checksum(model))  # evaluation leaves the buffers as it used them
    record["eval_hashes"].append(weights_hash(model))
    return result


target.build_model = build_model
target.train_one_epoch = train_one_epoch
target.evaluate = evaluate

if os.environ.get("PROBE_STUCK_DESTROY") == "1":
    import torch.distributed as dist

    import multi_train_utils.distributed_utils as distributed_utils

    dist.destroy_process_group = lambda *args, **kwargs: time.sleep(3600)
    distributed_utils.CLEANUP_SECONDS = 2

if os.environ.get("PROBE_BN_EVAL") == "1":
    real_set_train_mode = train_eval_utils.set_train_mode

    def set_train_mode_bn_eval(model):
        real_set_train_mode(model)
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eval()

    train_eval_utils.set_train_mode = set_train_mode_bn_eval
    # BatchNorm in eval mode takes a batch of one: the start-up check must not refuse it
    real_check_input_size = model_setup.check_input_size
    model_setup.check_input_size = lambda *args, **kwargs: real_check_input_size(*args, **dict(kwargs, training=False))

if os.environ.get("PROBE_COUNT_SYNCS") == "1":
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    real_ddp = target.DDP
    record["gradient_syncs"] = 0

    def counting_allreduce(state, bucket):
        record["gradient_syncs"] += 1
        return allreduce_hook(state, bucket)

    def ddp_counting_syncs(*args, **kwargs):
        model = real_ddp(*args, **kwargs)
        model.register_comm_hook(None, counting_allreduce)
        return model

    target.DDP = ddp_counting_syncs

if float(os.environ.get("PROBE_STEP_SLEEP", "0")) > 0:
    loss_forward = nn.CrossEntropyLoss.forward

    def slow_forward(self, x, y):
        time.sleep(float(os.environ["PROBE_STEP_SLEEP"]))
        return loss_forward(self, x, y)

    nn.CrossEntropyLoss.forward = slow_forward

real_loss_forward = nn.CrossEntropyLoss.forward


def parse_signal_spec(spec):
    """PROBE_SIGNAL's (signal, step, to, rank or None), or None where this process sends nothing."""
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    name, step, to, *only = spec.split(":")
    if (to == "launcher" and rank != 0) or (only and int(only[0]) != rank):
        return None
    return getattr(signal, name), int(step), to


def send_probe_signal(signum, step, to):
    os.kill(os.getppid() if to == "launcher" else os.getpid(), signum)


signal_at = parse_signal_spec(os.environ.get("PROBE_SIGNAL"))

if os.environ.get("PROBE_SIGNAL_IN_SAVE"):
    import multi_train_utils.recorder as recorder

    real_save_inside_epoch, real_torch_save = recorder.RunRecorder._save_inside_epoch, torch.save
    saving = []

    def save_inside_epoch(self, position):
        saving.append(True)
        try:
            return real_save_inside_epoch(self, position)
        finally:
            saving.pop()

    def torch_save_signalled(obj, f, *args, **kwargs):
        if saving and hasattr(f, "write"):
            f.write(b"PK")  # the file has begun
            f.flush()
            os.kill(os.getpid(), getattr(signal, os.environ["PROBE_SIGNAL_IN_SAVE"]))
            f.seek(0)
            f.truncate()
        return real_torch_save(obj, f, *args, **kwargs)

    recorder.RunRecorder._save_inside_epoch = save_inside_epoch
    torch.save = torch_save_signalled
stop = {"epoch": None, "step": 0, "saving": None}
stop_name, stop_point, stop_who = (os.environ.get("PROBE_STOP", "").split(":") + ["", "", ""])[:3]


def stop_here(point):
    """Send PROBE_STOP's signal if ``point`` is its point, this rank sends, and it was not sent yet."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return  # only in torchrun's first attempt
    if point != stop_point or stop.get("sent") or (stop_who == "launcher" and rank != 0) or \
            (stop_who.startswith("rank") and int(stop_who[4:]) != rank):
        return
    stop["sent"] = True
    if stop_name == "ENOSPC":
        import errno

        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    os.kill(os.getppid() if stop_who == "launcher" else os.getpid(), getattr(signal, stop_name))


if stop_point:
    import multi_train_utils.recorder as stop_recorder

    real_start_epoch = train_eval_utils.start_epoch

    def start_epoch_noted(*args, **kwargs):
        begun = real_start_epoch(*args, **kwargs)
        stop["step"] = begun[0]  # the epoch's first step: 0, or after a resume inside it where it goes on
        return begun

    train_eval_utils.start_epoch = start_epoch_noted
    real_build_for_stop, real_evaluate_for_stop = target.build_model, target.evaluate
    validated = set()

    def build_model_stopped(*args, **kwargs):
        stop_here("startup")
        return real_build_for_stop(*args, **kwargs)

    def evaluate_stopped(*args, **kwargs):
        if stop["epoch"] is not None and stop["epoch"] not in validated:
            validated.add(stop["epoch"])
            stop_here(f"validation-{stop['epoch']}")
        return real_evaluate_for_stop(*args, **kwargs)

    target.build_model, target.evaluate = build_model_stopped, evaluate_stopped
    real_write_run_settings = stop_recorder.write_run_settings

    def write_run_settings_stopped(*args, **kwargs):
        stop_here("run_files")
        return real_write_run_settings(*args, **kwargs)

    stop_recorder.write_run_settings = write_run_settings_stopped

    def saving_as(kind, save):
        def saved(*args, **kwargs):
            stop["saving"] = kind
            try:
                return save(*args, **kwargs)
            finally:
                stop["saving"] = None
        return saved

    real_save_epoch = stop_recorder.RunRecorder._save_epoch
    stop_recorder.RunRecorder._save_epoch = lambda self, epoch, *a, **k: saving_as(
        f"epoch_save-{epoch}", real_save_epoch)(self, epoch, *a, **k)
    stop_recorder.RunRecorder._save_inside_epoch = saving_as("inside_save", stop_recorder.RunRecorder._save_inside_epoch)
    real_save_for_stop = torch.save

    def torch_save_stopped(obj, f, *args, **kwargs):
        if stop["saving"] and hasattr(f, "write") and isinstance(obj, dict) and "optimizer" in obj:  # the checkpoint
            f.write(b"PK")  # the file has begun
            f.flush()
            stop_here(stop["saving"])
            f.seek(0)
            f.truncate()
        return real_save_for_stop(obj, f, *args, **kwargs)

    torch.save = torch_save_stopped

if os.environ.get("PROBE_REFUSE_DATA_RANK") == str(rank):
    import my_dataset

    from multi_train_utils.errors import UserError

    def refuse(*args, **kwargs):
        raise UserError("probe: this rank refuses the data")

    if rank == 0:
        my_dataset.read_split_data = refuse
    else:
        real_build_refused = target.build_datasets

        def build_then_refuse(args):
            real_build_refused(args)
            refuse()

        target.build_datasets = build_then_refuse

if os.environ.get("PROBE_LOADER_TIMEOUT"):
    import multi_train_utils.loaders as probe_loaders

    probe_loaders.WORKER_TIMEOUT_SECONDS = float(os.environ["PROBE_LOADER_TIMEOUT"])

val_worker_fault, _, val_worker_rank = os.environ.get("PROBE_VAL_WORKER", "").partition(":")
if val_worker_fault and int(val_worker_rank) == rank:
    import torch.utils.data as probe_data

    real_make_loader = target.make_loader

    class FaultyInWorker(probe_data.Dataset):
        """The validation set, whose items hang or end the process in a loader worker."""

        def __init__(self, dataset):
            self.dataset = dataset

        def __len__(self):
            return len(self.dataset)

        def __getitem__(self, index):
            if probe_data.get_worker_info() is not None:
                if val_worker_fault == "hang":
                    time.sleep(3600)
                if val_worker_fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer does
                os._exit(3)
            return self.dataset[index]

    def make_loader_faulty(dataset, *args, validation=False, **kwargs):
        return real_make_loader(FaultyInWorker(dataset) if validation else dataset, *args, validation=validation,
                                **kwargs)

    target.make_loader = make_loader_faulty

nan_ranks = os.environ.get("PROBE_NAN_RANK", "").split(",")
nan_steps = os.environ.get("PROBE_NAN_STEP", "0").split(",")
nan_step = int(nan_steps[nan_ranks.index(str(rank)) % len(nan_steps)]) if str(rank) in nan_ranks else None


def counted_loss_forward(self, x, y):
    """Counts training steps; on PROBE_NAN_RANK, a NaN loss value whose gradients are finite."""
    loss = real_loss_forward(self, x, y)
    record["loss"] = {"label_smoothing": self.label_smoothing, "class_weights": None if self.weight is None else
                      self.weight.tolist(), "soft_targets": y.dim() == 2}
    step, record["steps"] = record["steps"], record["steps"] + 1
    if os.environ.get("PROBE_RAISE_RANK") == str(rank) and os.environ.get("PROBE_RAISE_STEP") == str(step):
        raise RuntimeError(f"probe: rank {rank} fails at step {step}")
    if signal_at is not None and step == signal_at[1]:
        send_probe_signal(*signal_at)
    stop_at_this_step()
    if step == nan_step:
        loss = loss + torch.tensor(float("nan"), dtype=loss.dtype)  # d(loss)/d(x) is unchanged
    return loss


def stop_at_this_step():
    """PROBE_STOP's "step-E-S", counted by the training loss's calls (evaluation calls none)."""
    if stop_point and stop["epoch"] is not None:
        stop_here(f"step-{stop['epoch']}-{stop['step']}")
        stop["step"] += 1


def multi_label_loss_stopped(self, x, y):
    loss = real_multi_label_forward(self, x, y)
    stop_at_this_step()
    return loss


nn.CrossEntropyLoss.forward = counted_loss_forward
real_multi_label_forward = MultiLabelLoss.forward
MultiLabelLoss.forward = multi_label_loss_stopped  # a multi-label run's steps stop at their points too

main_pid, real_exit = os.getpid(), os._exit

if os.environ.get("PROBE_WRITES") == "1":
    written, record["writes"] = set(), []

    def for_writing(mode, flags):
        """open()'s mode ("wb", "a+"...) or os.open()'s flags ask to write."""
        return any(c in (mode or "") for c in "wax+") or bool((flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))

    def note_writes(event, args):
        if os.getpid() != main_pid or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
            return  # a loader worker, or a file descriptor rather than a path
        if event == "open" and for_writing(args[1], args[2]):
            written.add(os.path.abspath(os.fsdecode(args[0])))
        elif event in ("os.rename", "os.remove", "os.unlink"):  # os.replace is audited as os.rename
            written.add(os.path.abspath(os.fsdecode(args[1] if event == "os.rename" else args[0])))
        record["writes"] = sorted(written)

    sys.addaudithook(note_writes)


def write_record():
    if os.environ.get("PROBE_OUT") and os.getpid() == main_pid:  # not from a forked loader worker
        with open(f"{os.environ['PROBE_OUT']}.rank{rank}.json", "w") as f:
            json.dump(record, f)


def exit_recorded(code):
    """os._exit (the stop watchdog's way out) with the exit code recorded first."""
    if os.getpid() == main_pid:
        record["exit_code"] = code
        write_record()
    real_exit(code)


os._exit = exit_recorded

main = target.main
if os.environ.get("PROBE_GC_OFF") == "1":
    import gc

    from torch.nn.parallel import DistributedDataParallel

    def ddp_models():
        # by type: isinstance asks some objects' classes, and deprecated ones warn
        return sum(issubclass(type(o), DistributedDataParallel) for o in gc.get_objects())

    def main_counting(argv):
        target.main(argv)
        record["ddp_after_main"] = ddp_models()

    main = main_counting
    gc.disable()
try:
    run_cli(main, sys.argv[2:])
    record["exit_code"] = 0
except SystemExit as e:  # run_cli's exit code: 2 for bad input, 128 + N for signal N, ...
    record["exit_code"] = e.code
    raise
finally:
    if os.environ.get("PROBE_GC_OFF") == "1":
        record["ddp_at_exit"] = ddp_models()
    write_record()

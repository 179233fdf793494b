"""In-process checks of the pieces: split, dataset, samplers, schedule, environment, flags."""
import os
import random

import pytest
import torch

from conftest import CLASSES, full_flags


def test_split_is_stratified_deterministic_and_independent_of_listing_order(tiny_data, monkeypatch):
    from utils import read_split_data

    first = read_split_data(tiny_data["train"], val_rate=0.34, seed=3, check_images=True)
    random.seed(123)
    torch.manual_seed(123)
    real_scandir = os.scandir
    monkeypatch.setattr(os, "scandir", lambda p: iter(reversed(list(real_scandir(p)))))
    second = read_split_data(tiny_data["train"], val_rate=0.34, seed=3, check_images=True)
    assert first == second
    assert first.classes == CLASSES
    # round(n * 0.34) of each class: 8 -> 3, 6 -> 2, 8 -> 3, 7 -> 2, 7 -> 2 (broken.jpg skipped)
    per_class = [first.val_images_label.count(i) for i in range(5)]
    assert per_class == [3, 2, 3, 2, 2]
    assert not set(first.train_images_path) & set(first.val_images_path)
    assert len(first.train_images_path) + len(first.val_images_path) == 36
    assert [os.path.basename(p) for p in first.skipped] == ["broken.jpg"]
    other_seed = read_split_data(tiny_data["train"], val_rate=0.34, seed=4, check_images=True)
    assert other_seed.val_images_path != first.val_images_path


def test_every_image_mode_becomes_rgb(tiny_data):
    from multi_train_utils.datasets import MyDataSet
    from multi_train_utils.loaders import SeededSamples
    from utils import read_split_data
    from multi_train_utils.images import build_transforms

    split = read_split_data(tiny_data["train"], val_root=tiny_data["val"])
    odd = [i for i, p in enumerate(split.train_images_path)
           if os.path.basename(p) in ("gray.PNG", "rgba.png", "palette.png", "cmyk.JPEG", "photo.webp", "bitmap.bmp")]
    assert len(odd) == 6
    train_tf, val_tf = build_transforms(40)
    dataset = SeededSamples(MyDataSet(split.train_images_path, split.train_images_label, train_tf), seed=0)
    for i in odd:
        image, label = dataset[i]
        assert image.shape == (3, 40, 40) and image.dtype == torch.uint8  # normalised on the device
    # augmentation drawn from (seed, epoch, index): repeatable, and new every epoch
    assert torch.equal(dataset[(2, odd[0])][0], dataset[(2, odd[0])][0])
    assert not torch.equal(dataset[(2, odd[0])][0], dataset[(3, odd[0])][0])


def epoch_images(train_set, seed, epochs, workers):
    """{(epoch, index): image} through the scripts' real sampler and loader chain."""
    from torch.utils.data import DistributedSampler

    from multi_train_utils.loaders import EpochBatchSampler
    from multi_train_utils.loaders import make_loader

    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=seed)
    loader = make_loader(train_set, EpochBatchSampler(sampler, 4, world_size=1, rank=0), workers, torch.device("cpu"))
    seen = {}
    for epoch in epochs:
        sampler.set_epoch(epoch)
        order = [index for batch in loader.batch_sampler for _, index in batch]
        images = torch.cat([batch for batch, _ in loader])
        seen.update({(epoch, index): image for index, image in zip(order, images, strict=True)})
    return seen


def test_augmentation_changes_every_epoch_and_repeats_on_a_rerun(tiny_data):
    """Image i gets another random crop in epoch 1 than in epoch 0 (persistent loader workers
    included), and the same crops again in a rerun with the same seed and other workers."""

    from my_dataset import build_datasets

    from multi_train_utils.loaders import SeededSamples

    data = build_datasets(full_flags(train_list=None, data_path=tiny_data["train"], val_path=tiny_data["val"],
                                    val_rate=0.2, seed=0, img_size=24, check_images=True))  # 36: batches of 4
    train_set = SeededSamples(data.train, seed=0)
    first = epoch_images(train_set, seed=0, epochs=(0, 1), workers=1)
    indices = sorted({index for _, index in first})
    assert len(indices) == 36
    changed = [i for i in indices if not torch.equal(first[0, i], first[1, i])]
    assert changed == indices
    rerun = epoch_images(train_set, seed=0, epochs=(1,), workers=0)
    assert all(torch.equal(rerun[1, i], first[1, i]) for i in indices)


def test_shard_sampler_covers_each_index_once():
    from multi_train_utils.loaders import ShardSampler

    for world_size in (1, 2, 3, 4, 8):
        shards = [list(ShardSampler(7, r, world_size)) for r in range(world_size)]
        assert sorted(i for s in shards for i in s) == list(range(7))


def schedule_args(**changes):
    """The schedule's flags (cosine, no warm-up, --lrf 0.1, one batch per optimizer step), with ``changes``."""
    flags = dict(epochs=4, warmup_epochs=0, lrf=0.1, lr_scheduler="cosine", lr_step_size=30, lr_gamma=0.1,
                 accum_steps=1)
    return full_flags(**{**flags, **changes})


def test_lr_schedule_warms_up_then_follows_cosine_to_lrf():
    from model import create_lr_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = create_lr_scheduler(optimizer, schedule_args(epochs=5, warmup_epochs=1), batches_per_epoch=10)
    lrs = []
    for _ in range(50):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(0.01) and lrs[9] == pytest.approx(0.1)  # linear warm-up
    assert lrs[10] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.01, rel=0.02)  # close to lr * lrf at the last step


def test_slurm_hostlists():
    from multi_train_utils.distributed_utils import expand_slurm_hostlist

    assert expand_slurm_hostlist("node[01-04,07]") == ["node01", "node02", "node03", "node04", "node07"]
    assert expand_slurm_hostlist("a1,gpu[9-10]x,b") == ["a1", "gpu9x", "gpu10x", "b"]
    assert expand_slurm_hostlist("localhost") == ["localhost"]
    assert expand_slurm_hostlist("rack[1-2]-n[8-9]") == ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]


def test_plain_python_in_a_batch_script_is_one_process(monkeypatch):
    """sbatch sets SLURM_PROCID and SLURM_NTASKS for the batch script too; only srun's
    SLURM_STEP_NUM_TASKS makes it a distributed launch."""
    from multi_train_utils.distributed_utils import read_dist_env

    _clean_env(monkeypatch)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    env = read_dist_env()
    assert (env.world_size, env.distributed) == (1, False)


def _clean_env(monkeypatch):
    """Remove launcher variables; monkeypatch also undoes what read_dist_env sets later."""
    keys = [k for k in os.environ if k.startswith("SLURM_")]
    for key in keys + ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                       "TORCHELASTIC_RUN_ID"]:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def test_slurm_variables_give_rank_address_and_port(monkeypatch):
    from multi_train_utils.distributed_utils import read_dist_env

    _clean_env(monkeypatch)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2)")
    monkeypatch.setenv("SLURM_NODELIST", "gpu[03-04]")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    env = read_dist_env()
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.launcher) == (5, 8, 1, 4, "slurm")
    assert os.environ["MASTER_ADDR"] == "gpu03"
    assert os.environ["MASTER_PORT"] == str(15000 + 123456 % 17000)  # 15000 to 31999: below the ephemeral ports
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("5", "8", "1")


def test_torchrun_variables_win_over_slurm(monkeypatch):
    from multi_train_utils.distributed_utils import read_dist_env

    _clean_env(monkeypatch)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    for key, value in dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(key, value)
    env = read_dist_env(local_rank_arg=7)
    assert (env.rank, env.world_size, env.local_rank, env.launcher) == (3, 4, 1, "env")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert read_dist_env().launcher == "torchrun"


def test_no_launcher_is_a_single_process(monkeypatch):
    from multi_train_utils.distributed_utils import read_dist_env

    _clean_env(monkeypatch)
    env = read_dist_env()
    assert (env.rank, env.world_size, env.distributed) == (0, 1, False)


def test_more_processes_than_gpus_is_an_error(monkeypatch):
    from multi_train_utils import distributed_utils
    from multi_train_utils.errors import UserError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    assert distributed_utils.select_device("auto", local_rank=1, local_world_size=2) == torch.device("cuda", 1)
    with pytest.raises(UserError, match="4 processes per node but only 2 GPU"):
        distributed_utils.select_device("auto", local_rank=3, local_world_size=4)
    with pytest.raises(UserError, match="every process of this node would use that one GPU"):
        distributed_utils.select_device("cuda:1", local_rank=0, local_world_size=2)


def test_boolean_flags_and_aliases():
    from multi_train_utils.options import get_args_parser, given_on_command_line, parse_args

    parser = get_args_parser(distributed=True)
    args = parse_args(parser, ["--syncBN", "--no-freeze-layers", "--num_classes", "5", "--local_rank=2"])
    assert (args.sync_bn, args.freeze_layers, args.num_classes, args.local_rank) == (True, False, 5, 2)
    assert parse_args(parser, ["--no-sync-bn", "--local-rank=1"]).sync_bn is False
    assert parse_args(parser, []).sync_bn is None  # not given: off (use_sync_bn)
    assert given_on_command_line(parser, ["--epochs", "3", "--demo"]) == {"epochs", "demo"}
    demo = parse_args(parser, ["--demo", "--epochs", "5"])
    assert (demo.epochs, demo.model, demo.data_path) == (5, "resnet18", "data/demo")
    for flag in ("--sync-bn", "--dist-backend", "--dist-url", "--local-rank", "--scale-lr", "--spawn"):
        assert flag in parser.format_help()
    single = get_args_parser(distributed=False).format_help()
    assert "--data-parallel" in single and "--sync-bn" not in single


@pytest.mark.parametrize("name", ["fc", "classifier", "heads"])
def test_freeze_finds_the_head_of_any_architecture(name):
    from model import create_model
    from multi_train_utils.model_setup import freeze_all_but_head, set_train_mode

    model = create_model({"fc": "resnet18", "classifier": "mobilenet_v3_small", "heads": "vit_b_16"}[name], 3)
    assert freeze_all_but_head(model) == name
    trainable = {n.split(".")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {name}
    set_train_mode(model)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert all(not m.training for m in norms)


def test_a_save_interrupted_before_the_rename_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    from multi_train_utils import checkpoint as ckpt

    ckpt.save_checkpoint(str(tmp_path), {"epoch": 1, "model": {"w": torch.ones(2)}})
    real_replace = os.replace

    def crash_on_the_final_rename(src, dst):
        if dst.endswith(ckpt.CHECKPOINT):
            raise KeyboardInterrupt  # as if the process were stopped right here
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_the_final_rename)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(str(tmp_path), {"epoch": 2, "model": {"w": torch.zeros(2)}})
    monkeypatch.setattr(os, "replace", real_replace)
    assert torch.load(tmp_path / ckpt.CHECKPOINT, weights_only=True)["epoch"] == 1
    assert sorted(os.listdir(tmp_path)) == [ckpt.PREVIOUS_CHECKPOINT, ckpt.CHECKPOINT]  # no temporary files left


def test_resume_auto_falls_back_to_the_previous_checkpoint(tmp_path, capsys):
    from multi_train_utils import checkpoint as ckpt

    state = {"model": {"w": torch.ones(2)}, "optimizer": {}, "classes": ["a", "b"], "args": {}}
    ckpt.save_checkpoint(str(tmp_path), dict(state, epoch=4))
    ckpt.save_checkpoint(str(tmp_path), dict(state, epoch=5))
    assert ckpt.find_resume_checkpoint("auto", str(tmp_path))[1]["epoch"] == 5
    blob = (tmp_path / ckpt.CHECKPOINT).read_bytes()
    (tmp_path / ckpt.CHECKPOINT).write_bytes(blob[:100])  # damaged after the fact
    path, checkpoint = ckpt.find_resume_checkpoint("auto", str(tmp_path))
    assert path.endswith(ckpt.PREVIOUS_CHECKPOINT) and checkpoint["epoch"] == 4
    assert "may be truncated or of another format; trying the previous checkpoint" in capsys.readouterr().out
    assert ckpt.find_resume_checkpoint("auto", str(tmp_path / "empty")) == (None, None)


def test_the_schedule_continues_where_it_stopped_for_any_world_size():
    """Resumed at epoch 2 with half the steps per epoch (twice the ranks), the rate is what
    the schedule gives at that point, for the new base rate."""
    from model import create_lr_scheduler

    def rates(steps, start, base):
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
        scheduler = create_lr_scheduler(optimizer, schedule_args(), steps, start_epoch=start)
        out = []
        for _ in range((4 - start) * steps):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    assert rates(10, 2, 0.1) == pytest.approx(rates(10, 0, 0.1)[20:])
    assert rates(5, 2, 0.2)[0] == pytest.approx(2 * rates(10, 0, 0.1)[20])


def test_restore_derives_the_learning_rate_for_the_new_world_size():
    """Resumed on twice the processes: momentum buffers come from the checkpoint, the rate is
    the newly scaled one, and the schedule starts at the checkpoint's next epoch."""
    from model import create_lr_scheduler
    from multi_train_utils.checkpoint import TrainState, complete_checkpoint, restore_training_state

    weight = torch.nn.Parameter(torch.ones(3))
    before = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    create_lr_scheduler(before, schedule_args(), 5)  # as a run's: the groups' initial_lr is the old rate, 0.1
    weight.grad = torch.full((3,), 0.5)
    before.step()
    assert before.state_dict()["param_groups"][0]["initial_lr"] == 0.1
    checkpoint = complete_checkpoint({"optimizer": before.state_dict(), "epoch": 1,
                                      "rng": {"torch": torch.get_rng_state()}})

    after = torch.optim.SGD([weight], lr=0.2, momentum=0.9)
    start_epoch = restore_training_state(TrainState(None, after), checkpoint)  # after: created at the new rate
    scheduler = create_lr_scheduler(after, schedule_args(), 5, start_epoch=start_epoch)
    assert start_epoch == 2
    assert torch.equal(after.state[weight]["momentum_buffer"], torch.full((3,), 0.5))
    assert after.param_groups[0]["initial_lr"] == 0.2
    # half-way through the cosine: 0.2 * (0.1 + 0.9 * 0.5)
    assert after.param_groups[0]["lr"] == pytest.approx(0.2 * 0.55)
    assert scheduler.last_epoch == 10


def test_every_planted_bug_still_applies_and_names_a_test():
    """tests/mutants/*.patch (run by tests/mutants/run.sh) stay part of the suite: each applies
    to the code as it is, and its first line names a test function that exists."""
    import glob
    import re
    import subprocess

    from conftest import REPO

    patches = sorted(glob.glob(os.path.join(REPO, "tests", "mutants", "*.patch")))
    assert len(patches) >= 25
    for patch in patches:
        with open(patch) as f:
            first = f.readline()
        match = re.fullmatch(r"# test: (tests/\w+\.py)::(\w+)(\[[^\]]+\])?\n", first)
        assert match, (patch, first)
        with open(os.path.join(REPO, match.group(1))) as f:
            assert f"def {match.group(2)}(" in f.read(), (patch, first)
        check = subprocess.run(["git", "apply", "--check", patch], cwd=REPO, capture_output=True, text=True)
        assert check.returncode == 0, (patch, check.stderr)


def test_a_deprecation_is_an_error_in_the_suite_and_in_every_process_it_starts(tmp_path, monkeypatch):
    """What makes the suite fail the day the project calls a deprecated API: here pytest's
    filterwarnings, in a started script (forked from the prestarted Python or not) PYTHONWARNINGS."""
    import warnings

    from conftest import PYTHON, run

    for category in (DeprecationWarning, FutureWarning):
        with pytest.raises(category, match="an API of the past"):
            warnings.warn("an API of the past", category)
    old = tmp_path / "old.py"
    old.write_text("import warnings\nprint('before')\nwarnings.warn('an API of the past', FutureWarning)\n"
                   "print('after')\n")
    for fresh in ("0", "1"):  # TESTS_FRESH_PROCESSES=1: a new interpreter instead of a fork
        monkeypatch.setenv("TESTS_FRESH_PROCESSES", fresh)
        result = run([PYTHON, str(old)])
        assert result.returncode == 1 and result.stdout == "before\n", (fresh, result.stdout, result.stderr)
        assert "FutureWarning: an API of the past" in result.stderr


def test_a_worker_of_the_suites_torchrun_starts_as_a_worker_of_torchrun_does(tmp_path):
    """The suite's torchrun (tests/helpers/forking_torchrun.py) forks its workers instead of
    starting new interpreters: each must still begin as plain torchrun's do, with the signal
    handlers, descriptors, session, parent, argv, sys.path, environment, warning filters and
    collector of a new process; only the pids differ."""
    import json
    import time

    from conftest import PYTHON, REPO, TORCHRUN, ScriptProcess, free_port

    seen = tmp_path / "seen.py"
    seen.write_text(
        "import gc, json, os, signal, sys, warnings\n"
        "names = ['SIGINT', 'SIGTERM', 'SIGHUP', 'SIGQUIT', 'SIGUSR1', 'SIGUSR2', 'SIGPIPE', 'SIGXFSZ', 'SIGCHLD']\n"
        "try:\n"
        "    warnings.warn('an API of the past', FutureWarning)\n"
        "    warned = 'printed'\n"
        "except FutureWarning:\n"
        "    warned = 'raised'\n"
        "record = {'handlers': {n: repr(signal.getsignal(getattr(signal, n))) for n in names},\n"
        "          'descriptors': sorted(os.listdir('/proc/self/fd')), 'own_session': os.getsid(0) == os.getpid(),\n"
        "          'parent': os.getppid(),\n"
        "          'argv': sys.argv, 'path0': sys.path[0], 'rank': os.environ['RANK'], 'warned': warned,\n"
        "          'gc': gc.isenabled(), 'main': __name__, 'modules': 'multi_train_utils' in sys.modules}\n"
        "with open(sys.argv[1] + os.environ['RANK'], 'w') as f:\n"
        "    json.dump(record, f)\n")
    records = {}
    for name, launcher in (("plain", [PYTHON, "-m", "torch.distributed.run"]), ("suite", TORCHRUN)):
        torchrun = ScriptProcess([*launcher, "--nproc_per_node=2", "--master_port", str(free_port()), str(seen),
                                  str(tmp_path / name), "x y"], None, REPO)
        code, _, stderr, _ = torchrun.finish(time.monotonic() + 120)
        assert code == 0, stderr
        records[name] = [json.loads((tmp_path / f"{name}{rank}").read_text()) for rank in (0, 1)]
        for record in records[name]:
            record["argv"][1] = record["argv"][1].replace(str(tmp_path / name), "OUT")
            record["parent"] = "torchrun" if record["parent"] == torchrun.pid else record["parent"]
    for key in records["plain"][0]:
        assert [r[key] for r in records["suite"]] == [r[key] for r in records["plain"]], key
    assert [r["rank"] for r in records["suite"]] == ["0", "1"]
    assert records["suite"][0]["parent"] == "torchrun" and records["suite"][0]["own_session"]
    assert records["suite"][0]["handlers"]["SIGTERM"] == "<Handlers.SIG_DFL: 0>"


def test_resume_auto_finds_the_previous_checkpoint_where_it_is_the_only_one(tmp_path):
    from multi_train_utils import checkpoint as ckpt

    state = {"model": {"w": torch.ones(2)}, "optimizer": {}, "classes": ["a", "b"], "args": {}}
    ckpt.save_checkpoint(str(tmp_path), dict(state, epoch=4))
    ckpt.save_checkpoint(str(tmp_path), dict(state, epoch=5))
    os.remove(tmp_path / ckpt.CHECKPOINT)  # a run that resumed from the previous one and set the other aside
    path, checkpoint = ckpt.find_resume_checkpoint("auto", str(tmp_path))
    assert path == str(tmp_path / ckpt.PREVIOUS_CHECKPOINT) and checkpoint["epoch"] == 4


def test_a_run_that_hangs_is_ended_with_its_python_stack_in_the_failure(tmp_path):
    """The suite's guard against a hang: at the time-out the run's processes get SIGABRT and,
    with PYTHONFAULTHANDLER, print where they were; the failure's message ends with it."""
    import subprocess
    import time

    from conftest import PYTHON, run

    hanging = tmp_path / "hangs_here.py"
    hanging.write_text("import time\n\n\ndef waits_for_ever():\n    time.sleep(600)\n\n\nwaits_for_ever()\n")
    started, error = time.monotonic(), None
    try:
        run([PYTHON, str(hanging)], timeout=3)
    except subprocess.SubprocessError as e:
        error = e
    assert error is not None and time.monotonic() - started < 60
    message = str(error)
    assert "timed out after 3 seconds" in message and "Fatal Python error: Aborted" in message
    assert f'File "{hanging}", line 5 in waits_for_ever' in message

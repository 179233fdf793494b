"""The fault matrix: a run stopped at every point, by every kind of stop, under one process and
under torchrun with 2 processes, then resumed with --resume auto, ends as an uninterrupted run.

Stop points, in the order a run of 4 epochs meets them: start-up (as the model is built),
inside epoch 0, at epoch 0's last step, during epoch 1's validation, during a save inside an
epoch (after the file's first bytes), during epoch 2's checkpoint (likewise), inside epoch 3.
Each is reachable whatever the stop before it did (a notice at an epoch's last step, say,
skips that epoch's validation: the next point is in the next epoch). Kinds: SIGTERM and SIGUSR1
(preemption notices), Ctrl-C (SIGINT) and SIGKILL (a hard kill: the run goes on from the last
checkpoint written).

A chain is one run stopped at each point in turn, each stop resumed by the next run, the
last run going to the end; its kinds rotate over the points, so that 4 chains (a Latin
square) stop at every (point, kind) cell once. Every stop's exit code is docs/guarantees.md's,
every stop leaves a checkpoint that resumes, and the chain's end has the weights (1e-6), EMA and
metrics.csv rows of the uninterrupted run. One process runs all 4 chains; torchrun runs the
one (every point, every kind) and, with FAULT_MATRIX_FULL=1, all 4.
"""
import json
import os
import signal

import pytest
import torch

from conftest import (PROBE, PYTHON, TORCHRUN, free_port, metrics_without_timing, run, torchrun_passing_sigusr1,
                      train_args)

# 36 training images, batch 4: 9 steps an epoch in one process, 4 a rank at world size 2.
# A save inside the epoch at every step where the ranks agree (--print-freq 1); EMA and MixUp on.
RECIPE = ["--epochs", "4", "--workers", "0", "--print-freq", "1", "--checkpoint-every", "0.00001",
          "--model-ema", "--model-ema-decay", "0.9", "--mixup-alpha", "0.4"]
STEPS = {"single": 9, "torchrun": 4}
KINDS = ("SIGTERM", "SIGUSR1", "SIGKILL", "SIGINT")
NOTICES = ("SIGTERM", "SIGUSR1")


def points(launcher):
    """The stop points of a run, in the order it meets them (each one reachable after any stop
    at the one before)."""
    return ["startup", "step-0-1", f"step-0-{STEPS[launcher] - 1}", "validation-1", "inside_save", "epoch_save-2",
            "step-3-2"]


def chain_kinds(chain):
    """The kind of stop at each point of chain ``chain`` (0 to 3): a Latin square over the 4 chains."""
    return [KINDS[(point + chain) % len(KINDS)] for point in range(7)]


def who(launcher, kind, point):
    """Who sends the stop. One process: itself. torchrun: SIGTERM, SIGUSR1 and Ctrl-C go to
    torchrun, which passes them on to every worker (a cluster's SIGTERM, SLURM's SIGUSR1 with
    the documented --signals-to-handle, a terminal's Ctrl-C); SIGKILL reaches one worker alone
    (a crashed node): rank 1, or rank 0 where only rank 0 is (a save)."""
    if launcher == "single":
        return "self"
    if kind != "SIGKILL":
        return "launcher"
    return "rank0" if "save" in point else "rank1"


def expected_codes(launcher, kind, point):
    """docs/guarantees.md's exit codes of the ranks that get the stop, and those the others may
    have: a notice once the epochs run saves and exits 75 on every rank; before (start-up) it
    stops as Ctrl-C does, 128 + the signal; Ctrl-C is 130; SIGKILL ends the process (-9), and
    a rank whose peer is gone stops with "lost contact" (1), or, before the epochs run, on the
    SIGTERM that torchrun sends the rest when one worker failed (143)."""
    number = getattr(signal, kind)
    if kind == "SIGKILL":
        signalled = -number
    elif kind in NOTICES and point != "startup":
        signalled = 75
    else:
        signalled = 128 + number
    if launcher == "single" or who(launcher, kind, point) == "launcher":
        return {signalled}, {signalled}
    # a rank whose peer is gone: "lost contact" (1), or torchrun's SIGTERM to it before the epochs run (143)
    others = {75} if signalled == 75 else {1, 128 + signal.SIGTERM}
    return {signalled}, others


def command(launcher, tiny_data, out, *extra):
    flags = train_args(tiny_data, out, *RECIPE, "--resume", "auto", *extra)
    if launcher == "single":  # one thread: two chains run side by side on 2 cores (see single_chains)
        return [PYTHON, PROBE, "single", *flags, "--threads", "1"]
    return [*TORCHRUN, "--nproc_per_node=2", "--max-restarts=0", *torchrun_passing_sigusr1()[0],
            "--master_port", str(free_port()), PROBE, "multi", *flags]


def exit_codes(launcher, prefix, result):
    """Each rank's exit code: its probe record's (run_cli's, or the stop watchdog's), or -9 for a
    rank killed before it could write one."""
    codes = []
    for rank in range(1 if launcher == "single" else 2):
        path = f"{prefix}.rank{rank}.json"
        codes.append(json.load(open(path))["exit_code"] if os.path.exists(path) else -signal.SIGKILL)
    return codes


def assert_same_run(out, reference, epochs=4):
    """The same metrics rows (timing aside), epoch weights, checkpoint and EMA (1e-6) as ``reference``."""
    assert metrics_without_timing(out) == metrics_without_timing(reference)
    for name in [f"model-{epoch}.pth" for epoch in range(epochs)] + ["model-best.pth"]:
        got, expected = (torch.load(d / name, weights_only=True) for d in (out, reference))
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-6, msg=f"{name}: {key}")
    got, expected = (torch.load(d / "checkpoint.pth", weights_only=True) for d in (out, reference))
    assert got["position"] is None and got["epoch"] == epochs - 1
    for key, value in expected["model_ema"]["weights"].items():
        torch.testing.assert_close(got["model_ema"]["weights"][key], value, rtol=0, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory):
    """The uninterrupted run of each launcher, made the first time a test asks."""
    done = {}

    def reference(launcher):
        if launcher not in done:
            out = tmp_path_factory.mktemp(f"straight-{launcher}") / "out"
            result = run(command(launcher, tiny_data, out))
            assert result.returncode == 0, result.stdout + result.stderr
            done[launcher] = out
        return done[launcher]

    return reference


def assert_stop_kept_the_promise(launcher, kind, point, out, codes, result):
    """What the stop left: the exit codes; a notice's checkpoint at the step it promises."""
    signalled, others = expected_codes(launcher, kind, point)
    sender = who(launcher, kind, point)
    text = f"{kind} at {point} ({launcher}): {codes}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    if launcher == "single" or sender == "launcher":
        assert set(codes) <= signalled, text
    else:
        target = 0 if sender == "rank0" else 1
        assert codes[target] in signalled and codes[1 - target] in others, text
        if codes[1 - target] == 1:  # its peer was killed: one line, not a traceback (torchrun's own aside)
            tracebacks = result.stderr.count("Traceback") - result.stderr.count("errors.ChildFailedError")
            assert "error: lost contact with another process" in result.stderr and tracebacks == 0, text
    epoch, step = ([int(part) for part in point.split("-")[1:]] + [None, None])[:2]
    if kind in NOTICES and point != "startup":
        checkpoint = torch.load(out / "checkpoint.pth", weights_only=True)
        if point.startswith("step") and step < STEPS[launcher] - 1:  # inside the epoch: saved at the step's end
            assert (checkpoint["epoch"], checkpoint["position"]["epoch"], checkpoint["position"]["step"]) == \
                   (epoch - 1, epoch, step + 1), text
        elif point != "inside_save":  # the epoch's last step, its validation, its save: the epoch's checkpoint
            assert (checkpoint["epoch"], checkpoint["position"]) == (epoch, None), text
        assert "on a preemption notice" in result.stderr and "--resume auto" in result.stderr, text
    if kind == "SIGINT" and point.startswith("epoch_save"):  # Ctrl-C waits for the write, then stops
        assert torch.load(out / "checkpoint.pth", weights_only=True)["epoch"] == epoch, text
    if kind == "SIGINT":  # one line on how to go on; no traceback but torchrun's own (its SignalException)
        tracebacks = result.stderr.count("Traceback") - result.stderr.count("api.SignalException: Process")
        assert tracebacks == 0 and "--resume auto" in result.stderr, text


def run_chain(launcher, chain, tiny_data, tmp_path):
    """Chain ``chain`` of ``launcher``: one stop at each point, each resumed by the next run."""
    out = tmp_path / "out"
    for point, kind in zip(points(launcher), chain_kinds(chain)):
        prefix = tmp_path / f"{point}.probe"
        result = run(command(launcher, tiny_data, out),
                     env={"PROBE_OUT": str(prefix), "PROBE_STOP": f"{kind}:{point}:{who(launcher, kind, point)}",
                          **torchrun_passing_sigusr1()[1]})
        codes = exit_codes(launcher, prefix, result)
        assert_stop_kept_the_promise(launcher, kind, point, out, codes, result)
    final = run(command(launcher, tiny_data, out))
    assert final.returncode == 0, final.stdout + final.stderr
    return out


@pytest.fixture(scope="module")
def single_chains(tiny_data, tmp_path_factory, straight):
    """The uninterrupted run and the 4 chains of one process, two at a time (a one-thread run
    leaves a core idle): for each chain, its output folder or the exception that ended it."""
    from concurrent.futures import ThreadPoolExecutor

    def chain_or_error(chain):
        try:
            if chain is None:
                return straight("single")
            return run_chain("single", chain, tiny_data, tmp_path_factory.mktemp(f"chain-{chain}"))
        except BaseException as e:  # noqa: BLE001 (re-raised in the chain's own test)
            return e

    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(chain_or_error, [None, 0, 1, 2, 3]))[1:]


@pytest.mark.parametrize("chain", range(4))
def test_one_process_stopped_at_every_point_by_every_kind_resumes_to_the_uninterrupted_run(
        straight, single_chains, chain):
    ended = single_chains[chain]
    if isinstance(ended, BaseException):
        raise ended
    assert_same_run(ended, straight("single"))


# chain 3 by default: SIGTERM inside epoch 0, SIGUSR1 at its last step, SIGKILL during validation, Ctrl-C
# during the epoch's save (every kind and every point once)
@pytest.mark.parametrize("chain", [3] + ([0, 1, 2] if os.environ.get("FAULT_MATRIX_FULL") == "1" else []))
def test_torchrun_stopped_at_every_point_by_every_kind_resumes_to_the_uninterrupted_run(
        tiny_data, tmp_path, straight, chain):
    assert_same_run(run_chain("torchrun", chain, tiny_data, tmp_path), straight("torchrun"))

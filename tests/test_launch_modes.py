"""Every way of starting training, end to end on CPU: files written and metrics rows."""
import glob
import os
import re
import shlex

from conftest import (CORES, DEPRECATIONS_AS_ERRORS, PROBE, PYTHON, REPO, TORCHRUN, StartedJob, assert_run_outputs,
                      cpuinfo_lists_bf16, free_port, kill_tree, probe_records, read_metrics, run, script, train_args)
from multi_train_utils import images



def threads_text(count):
    """How the start summary names a process's threads: "(1 thread)", "(2 threads)"."""
    return f"({count} thread{'s' * (count != 1)})"

def assert_default_precision(stdout, records):
    """--amp auto: bf16 exactly when /proc/cpuinfo lists bf16 instructions, printed and used by
    the first convolution of every rank; channels_last on."""
    bf16 = cpuinfo_lists_bf16()
    assert f"amp: {'bf16' if bf16 else 'off'} (auto: " in stdout
    assert "channels_last: on" in stdout
    for record in records:
        assert record["conv_dtype"] == ("bfloat16" if bf16 else "float32"), record
        assert record["conv_channels_last"] is True


def test_python_train_single(single_run):
    stdout = single_run["result"].stdout
    assert_run_outputs(single_run["out"], epochs=2, stdout=stdout)  # counts over exactly the 7 val images
    # 30 + 6 images in other modes and formats; the broken one skipped, hidden and .txt files ignored
    assert "split: 36 train, 7 val images" in stdout
    assert "broken.jpg: not a readable image" in stdout
    assert ".hidden" not in stdout and "notes.txt" not in stdout
    assert threads_text(CORES) in stdout  # one process gets all the cores
    assert (single_run["probe"]["loader_workers"], single_run["probe"]["threads"]) == (1, CORES)  # --workers 1
    # the decoder of each format present: JPEGs by TorchCodec (where installed), the PNG, BMP, ... by PIL
    assert f"loader worker per process; JPEG decoded by {images.JPEG_DECODER}; " in stdout
    assert re.search(r"; [A-Z, ]*PNG[A-Z, ]* by PIL\n", stdout), stdout
    assert_default_precision(stdout, [single_run["probe"]])  # the fast defaults, printed and used
    # TensorBoard events from rank 0
    assert glob.glob(single_run["out"] + "-tb/*/events.out.tfevents.*")


def test_torchrun_two_processes(ddp_run):
    stdout = ddp_run["result"].stdout
    assert_run_outputs(ddp_run["out"], epochs=2, lr=0.002, steps_per_epoch=4, stdout=stdout)  # 18 images a rank
    assert_default_precision(stdout, ddp_run["probe"])
    assert "world size: 2 (torchrun, backend gloo)" in stdout
    assert stdout.count("split: 36 train, 7 val images") == 1  # only rank 0 prints
    assert "batch: 4 per process x 1 accumulation step x 2 processes = 8 per optimizer step" in stdout
    assert "lr: 0.002" in stdout  # 0.001 scaled by the world size
    assert threads_text(max(1, CORES // 2)) in stdout  # the cores shared by 2 processes
    assert [(r["loader_workers"], r["threads"]) for r in ddp_run["probe"]] == [(0, max(1, CORES // 2))] * 2
    assert len(glob.glob(ddp_run["out"] + "-tb/*")) == 1  # one TensorBoard writer


def test_torch_distributed_launch(tiny_data, tmp_path):
    """The deprecated launcher passes --local-rank=K; the script accepts it. Also --syncBN on CPU.
    The launcher's own FutureWarning is the user's to see, not an error of the suite's."""
    out = tmp_path / "out"
    launcher_deprecated = "default:The module torch.distributed.launch is deprecated:FutureWarning"
    result = run([PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node=2", "--master_port", str(free_port()),
                  script("train_multi_gpu.py"), "--syncBN",
                  *train_args(tiny_data, out, "--epochs", "1", "--workers", "0")],
                 env={"PYTHONWARNINGS": ",".join(DEPRECATIONS_AS_ERRORS + (launcher_deprecated,))})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FutureWarning: The module torch.distributed.launch is deprecated" in result.stderr
    assert "world size: 2" in result.stdout
    # torch has SyncBatchNorm for GPUs only: on CPU a warning, once, and plain BatchNorm
    assert result.stdout.count("warning: --sync-bn needs GPUs; keeping plain BatchNorm on CPU") == 1
    assert_run_outputs(str(out), epochs=1, lr=0.002, steps_per_epoch=4, stdout=result.stdout)


def test_multi_gpu_script_without_launcher(tiny_data, tmp_path):
    out = tmp_path / "out"
    result = run([PYTHON, script("train_multi_gpu.py"), *train_args(tiny_data, out, "--epochs", "1", "--workers", "0")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world size: 1 (none" in result.stdout
    assert_run_outputs(str(out), epochs=1, stdout=result.stdout)


def finish_all(jobs, timeout=180):
    """Each job's (stdout, stderr) once all have ended; on a time-out every job is killed."""
    try:
        return [job.communicate(timeout=timeout) for job in jobs]
    finally:
        for job in jobs:
            if job.poll() is None:
                kill_tree(job.pid)


def test_two_nodes_of_one_process(tiny_data, tmp_path):
    """torchrun --nnodes=2 as two invocations on 127.0.0.1; only global rank 0 writes."""
    out, port = tmp_path / "out", str(free_port())
    jobs = [StartedJob([*TORCHRUN, "--nnodes=2", f"--node_rank={r}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                        f"--master_port={port}", script("train_multi_gpu.py"),
                        *train_args(tiny_data, out, "--epochs", "1", "--workers", "0")])
            for r in (0, 1)]
    outputs = finish_all(jobs)  # (stdout, stderr) of each node
    assert [job.returncode for job in jobs] == [0, 0], outputs
    assert "world size: 2 (torchrun" in outputs[0][0]
    assert "split:" not in "".join(outputs[1])  # node 1 holds rank 1: silent
    assert_run_outputs(str(out), epochs=1, lr=0.002, steps_per_epoch=4, stdout=outputs[0][0])


def test_slurm_environment(tiny_data, tmp_path):
    """srun python train_multi_gpu.py: rank, world size, address (first host of the node list)
    and port (from the job id) from SLURM_* variables."""
    out, port = tmp_path / "out", free_port(15000, 32000)
    cmd = [PYTHON, script("train_multi_gpu.py"), *train_args(tiny_data, out, "--epochs", "1", "--workers", "0")]
    jobs = [StartedJob(cmd,
                       dict(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_LOCALID=str(rank),
                            SLURM_STEP_TASKS_PER_NODE="2", SLURM_NODELIST="localhost", SLURM_JOB_ID=str(port - 15000)))
            for rank in (0, 1)]
    outputs = finish_all(jobs)  # (stdout, stderr) of each task
    assert [job.returncode for job in jobs] == [0, 0], outputs
    assert "world size: 2 (slurm, backend gloo)" in outputs[0][0]
    assert threads_text(max(1, CORES // 2)) in outputs[0][0]  # 2 tasks per node share the cores
    assert_run_outputs(str(out), epochs=1, lr=0.002, steps_per_epoch=4, stdout=outputs[0][0])


def test_data_parallel_flag_on_cpu(tiny_data, tmp_path):
    out = tmp_path / "out"
    result = run([PYTHON, script("train_single.py"), "--data-parallel",
                  *train_args(tiny_data, out, "--epochs", "1", "--workers", "0")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning: --data-parallel needs 2 or more GPUs, 0 visible" in result.stdout
    assert_run_outputs(str(out), epochs=1, stdout=result.stdout)


def test_spawn_two_processes(tiny_data, tmp_path):
    out = tmp_path / "out"
    result = run([PYTHON, script("train_multi_gpu.py"), "--spawn", "2",
                  *train_args(tiny_data, out, "--epochs", "1", "--workers", "0")])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world size: 2 (env, backend gloo)" in result.stdout  # spawned: rank from the environment
    assert_run_outputs(str(out), epochs=1, lr=0.002, steps_per_epoch=4, stdout=result.stdout)


def readme_commands_after(text):
    """The lines of the README's first code block after the line that starts with ``text``."""
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    block = readme[readme.index("\n" + text):].split("```")[1]
    return [line for line in block.splitlines()[1:] if line.strip() and not line.startswith("#")]


def test_demo_generates_data_and_learns_as_well_in_bf16_as_in_fp32(tmp_path):
    """--demo writes a learnable dataset the first time and trains on it far above chance (0.2)
    in fp32 and in bf16 autocast, on every CPU: the first convolution really runs in fp32 with
    --amp off and in bf16 with --amp bf16 (emulated where the CPU has no bf16 instructions),
    and both end at a validation accuracy of at least 0.8. What bf16 changes in a step is
    checked to its precision by test_speed.py's one-step test; a 3-epoch trajectory is chaotic,
    so only the floor is compared here. The second --demo run (bf16, 32 px to keep emulated
    bf16 short, one thread) reuses the data as it is, beside the README's commands."""
    data = tmp_path / "demo"

    def demo(amp, *flags):
        out = tmp_path / amp
        return run([PYTHON, PROBE, "single", "--demo", "--data-path", str(data), "--img-size", "32",
                    "--epochs", "3", "--workers", "1", "--amp", amp, "--output-dir", str(out),
                    "--log-dir", str(tmp_path / f"tb-{amp}"), *flags], env={"PROBE_OUT": str(out)})

    from concurrent.futures import ThreadPoolExecutor

    results = {"off": demo("off")}
    classes = sorted(p.name for p in data.iterdir() if p.is_dir())
    assert classes == ["daisy", "dandelion", "roses", "sunflowers", "tulips"]
    assert all(len(os.listdir(data / c)) == 60 for c in classes)
    stamp = os.stat(data / "daisy" / "daisy_0000.jpg").st_mtime_ns
    with ThreadPoolExecutor(max_workers=1) as pool:
        bf16 = pool.submit(demo, "bf16", "--threads", "1")
        if results["off"].returncode == 0:
            check_the_readme_commands_after_the_demo(tmp_path, data)
        results["bf16"] = bf16.result()
    for amp, dtype in (("off", "float32"), ("bf16", "bfloat16")):
        out, result = tmp_path / amp, results[amp]
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"amp: {amp}," in result.stdout
        assert probe_records(out, 1)[0]["conv_dtype"] == dtype
        rows = read_metrics(str(out))
        assert len(rows) == 3
        assert float(rows[-1]["val_accuracy"]) >= 0.8, (amp, rows)
        # --keep-last's default, 1: of the per-epoch weights only the last epoch's stay
        assert sorted(p.name for p in out.glob("model-*.pth")) == ["model-2.pth", "model-best.pth"]
    assert os.stat(data / "daisy" / "daisy_0000.jpg").st_mtime_ns == stamp  # the second --demo reused it


def check_the_readme_commands_after_the_demo(tmp_path, data):
    """The README's examples after the demo, as written, in a project folder holding the demo's
    fp32 run: each exits 0 and writes only into git-ignored folders."""
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    os.symlink(tmp_path / "off", project / "weights")
    os.symlink(data, project / "data" / "demo")
    commands = readme_commands_after("After the demo, these examples work as written")
    for command in commands:
        argv = shlex.split(command)
        assert argv[0] == "python" and argv[1].endswith(".py"), command
    # they read the run and write to different places: two at a time (each is mostly start-up);
    # the one that reads export.py's model-best.pt2 starts when the export has ended
    from concurrent.futures import ThreadPoolExecutor

    (export_command,) = [c for c in commands if c.startswith("python export.py")]

    def readme_run(command):
        if "model-best.pt2" in command:
            exported.result()
        return command, run([PYTHON, script(shlex.split(command)[1]), *shlex.split(command)[2:]], cwd=str(project))

    with ThreadPoolExecutor(max_workers=2) as pool:
        exported = pool.submit(readme_run, export_command)
        results = [exported] + [pool.submit(readme_run, c) for c in commands if c != export_command]
        results = [future.result() for future in results]
    assert len(results) == len(commands) and any("model-best.pt2" in c for c, _ in results)
    for command, result in results:
        assert result.returncode == 0, command + "\n" + result.stdout + result.stderr
    assert set(os.listdir(project)) <= {"data", "runs", "weights"}  # only into git-ignored folders
    assert (tmp_path / "off" / "model-best.pt2").is_file()
    # The README's "a second `--demo`": it stops before anything is made or written, saying what to do.
    def files():  # (but run.lock, which every run into the folder takes first)
        return {p.name: p.stat().st_mtime_ns for p in (tmp_path / "off").iterdir() if p.name != "run.lock"}

    before = files()
    again = run([PYTHON, script("train_single.py"), "--demo"], cwd=str(project))
    line = again.stderr.strip()
    assert again.returncode == 2 and "\n" not in line, again.stderr
    assert line.startswith("error: --output-dir weights: holds the run of an earlier --demo (") and line.endswith(
        "); the demo's data is made once, and its run is kept: add --overwrite to train the demo again in its place, "
        "or choose another --output-dir to keep both"), line
    assert files() == before
    (predicted,) = [r.stdout for c, r in results if c.startswith("python predict.py --weights weights/model-best.pt2")]
    (eager,) = [r.stdout for c, r in results if c.startswith("python predict.py --weights weights/model-best.pth")]
    assert predicted.split()[:2] == eager.split()[:2] and predicted.startswith("data/demo/roses/roses_0001.jpg: ")
    assert (project / "weights" / "eval" / "confusion_matrix.csv").is_file()

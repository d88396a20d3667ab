"""The SLURM and local launch scripts: shell syntax, and the flags they pass parse."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SHELL_SCRIPTS = ["train_sap_slurm.sbatch", "train_sap_local.sh", "sap_llama3_8b_flags.sh", "smoke_train_sap.sh"]
FLAG_ENV = {"DATA_PATH": "/data/llama3_text_document", "TOKENIZER_MODEL": "/models/llama3-tokenizer"}


@pytest.mark.parametrize("name", SHELL_SCRIPTS)
def test_shell_syntax(name: str) -> None:
    result = subprocess.run(["bash", "-n", str(SCRIPTS / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _training_flags(**env: str) -> list[str]:
    """SAP_TRAINING_ARGS as the scripts build it, one flag or value per element."""
    command = f'source "{SCRIPTS / "sap_llama3_8b_flags.sh"}" && printf "%s\\n" "${{SAP_TRAINING_ARGS[@]}}"'
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                            env={**os.environ, **FLAG_ENV, **env})
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_flags_file_requires_data_and_tokenizer() -> None:
    env = {k: v for k, v in os.environ.items() if k not in FLAG_ENV}
    command = f'source "{SCRIPTS / "sap_llama3_8b_flags.sh"}"'
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env)
    assert result.returncode != 0 and "DATA_PATH" in result.stderr


def test_data_path_takes_one_prefix_or_a_blend() -> None:
    flags = _training_flags()
    assert flags[flags.index("--data-path") + 1:flags.index("--split")] == [FLAG_ENV["DATA_PATH"]]
    flags = _training_flags(DATA_PATH="0.7 /data/web_text_document  0.3 /data/code_text_document")
    assert flags[flags.index("--data-path") + 1:flags.index("--split")] == [
        "0.7", "/data/web_text_document", "0.3", "/data/code_text_document"]


@pytest.mark.parametrize("env, match", [({"NPROC": "4", "SAP_INNER": "3"}, "SAP_INNER\\*SAP_OUTER=3\\*1"),
                                        ({"NPROC": "6", "SAP_INNER": "2", "SAP_OUTER": "2"}, "NPROC=6"),
                                        ({"NPROC": "abc"}, "NPROC=abc must be a positive integer"),
                                        ({"SAP_INNER": "0"}, "SAP_INNER=0 must be a positive integer"),
                                        ({"STEPS": "-1"}, "STEPS=-1 must be a positive integer")])
def test_local_cpu_run_checks_its_sizes(env: dict, match: str) -> None:
    import re

    result = subprocess.run(["bash", str(SCRIPTS / "train_sap_local.sh")], capture_output=True, text=True,
                            env={**os.environ, "DEVICE": "cpu", "PYTHON": "false", **env}, timeout=60)
    assert result.returncode == 2 and re.search(match, result.stderr), result.stderr


def test_flags_take_a_calibration_file_instead_of_the_preset() -> None:
    assert "--sap-cost-preset" in _training_flags() and "--sap-calibration-file" not in _training_flags()
    flags = _training_flags(SAP_CALIBRATION_FILE="/data/calibration.json")
    assert "--sap-cost-preset" not in flags
    assert flags[flags.index("--sap-calibration-file") + 1] == "/data/calibration.json"


def test_sap_flags_in_the_scripts_parse() -> None:
    pytest.importorskip("megatron.core")
    from megatron_sap.megatron import add_sap_args
    from megatron_sap.megatron.arguments import sap_settings_from_args
    from megatron_sap.megatron.options import reset_sap_options

    flags = _training_flags(SAP_INNER="2", SAP_OUTER="8")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--context-parallel-size", type=int)
    parser.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int)
    parser.add_argument("--cp-comm-type", nargs="+")
    args, _ = add_sap_args(parser).parse_known_args(flags)
    assert args.cp_comm_type == ["sap"] and args.context_parallel_size == 16
    try:
        settings = sap_settings_from_args(args)
    finally:
        reset_sap_options()
    assert (settings.inner_size, settings.outer_size) == (2, 8)
    assert "--calculate-per-token-loss" in flags and "--reset-position-ids" in flags and "--reset-attention-mask" in flags


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_PATH"), reason="set MEGATRON_LM_PATH to parse with Megatron-LM's own parser")
def test_all_script_flags_parse_with_megatron_lm() -> None:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from megatron.training.arguments import parse_args\n"
        "from megatron_sap.megatron import add_sap_args\n"
        "sys.argv = ['pretrain_gpt.py'] + sys.argv[2:]\n"
        "args = parse_args(add_sap_args)\n"
        "assert args.cp_comm_type == ['sap'] and args.hierarchical_context_parallel_sizes == [4, 4]\n"
        "assert args.sap_log_interval == 100 and args.sap_choose_by == 'estimate'\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code, os.environ["MEGATRON_LM_PATH"], *_training_flags()],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_gpu_workflow_runs_existing_scripts() -> None:
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((SCRIPTS.parent / ".github" / "workflows" / "gpu.yml").read_text())
    steps = workflow["jobs"]["cuda"]["steps"]
    commands = " ".join(step.get("run", "") for step in steps)
    for script in ("scripts/gpu_check.sh", "scripts/smoke_train_sap.sh"):
        assert script in commands and (SCRIPTS.parent / script).is_file()


@pytest.mark.parametrize("nproc, tp, inner", [(8, 2, 4), (1, 1, 1)])
def test_local_cuda_training_defaults_to_tp_2(tmp_path: Path, nproc: int, tp: int, inner: int) -> None:
    """On one node's GPUs the local script runs the 8B model at TP 2 (1 on one GPU), SAP over
    the rest of the node; the command is recorded by a stand-in interpreter."""
    stand_in = tmp_path / "python"
    stand_in.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$ARGS_FILE"\n')
    stand_in.chmod(0o755)
    env = {**os.environ, **FLAG_ENV, "DEVICE": "cuda", "MEGATRON_LM_PATH": str(tmp_path), "PYTHON": str(stand_in),
           "NPROC": str(nproc), "ARGS_FILE": str(tmp_path / "args")}
    for name in ("TP", "SAP_INNER", "SAP_OUTER", "SEQ_LENGTH"):
        env.pop(name, None)
    result = subprocess.run(["bash", str(SCRIPTS / "train_sap_local.sh")], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "args").read_text().splitlines()
    assert args[args.index("--tensor-model-parallel-size") + 1] == str(tp)
    assert args[args.index("--sap-inner-size") + 1] == str(inner)
    assert args[args.index("--sap-outer-size") + 1] == "1"


@pytest.mark.parametrize("nproc", [1, 4, 6, 7])
def test_smoke_script_picks_a_sequence_length_its_cp_size_divides(tmp_path: Path, nproc: int) -> None:
    """The smoke run's default sequence length divides by 2 x CP for any GPU count (Megatron-LM's
    check, and SAP's T / P); one given that does not is refused before anything starts. The
    training command is recorded by a stand-in interpreter that logs two falling losses."""
    stand_in = tmp_path / "python"
    stand_in.write_text(
        "#!/bin/bash\n"
        'if [ "$1" = "-m" ]; then printf "%s\\n" "$@" > "$ARGS_FILE"; echo "lm loss: 2.0"; echo "lm loss: 1.0"; exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    stand_in.chmod(0o755)
    env = {**os.environ, "MEGATRON_LM_PATH": str(tmp_path), "PYTHON": str(stand_in), "NPROC": str(nproc),
           "ARGS_FILE": str(tmp_path / "args"), "LOG": str(tmp_path / "log")}
    result = subprocess.run(["bash", str(SCRIPTS / "smoke_train_sap.sh")], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "args").read_text().splitlines()
    seq = int(args[args.index("--seq-length") + 1])
    inner, outer = int(args[args.index("--sap-inner-size") + 1]), int(args[args.index("--sap-outer-size") + 1])
    assert inner * outer == nproc and seq % (2 * nproc) == 0 and 8192 - 2 * nproc < seq <= 8192
    refused = subprocess.run(["bash", str(SCRIPTS / "smoke_train_sap.sh")], capture_output=True, text=True,
                             env={**env, "SEQ_LENGTH": str(seq + 1)}, timeout=120)
    assert refused.returncode == 2 and f"must be divisible by 2 x CP = {2 * nproc}" in refused.stderr
    for inner in ("0", str(nproc + 1)):
        refused = subprocess.run(["bash", str(SCRIPTS / "smoke_train_sap.sh")], capture_output=True, text=True,
                                 env={**env, "SAP_INNER": inner}, timeout=120)
        assert refused.returncode == 2 and f"SAP_INNER={inner} must be a positive divisor of NPROC={nproc}" in refused.stderr


def slurm_stand_ins(tmp_path: Path, left: str | None = None) -> dict[str, str]:
    """The environment of a 2-node SLURM job whose srun, squeue (the time left: `left`) and
    scontrol are stand-ins; srun records its arguments in tmp_path / srun_args."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f"#!/bin/bash\necho '{left or ''}'\n")
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node-a; echo node-b\n")
    (bin_dir / "srun").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > "{tmp_path}/srun_args"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, **FLAG_ENV, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MEGATRON_LM_PATH": str(tmp_path),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2",
           "SLURM_NTASKS_PER_NODE": "8", "SAP_SCRIPTS_DIR": str(SCRIPTS)}
    env.pop("EXIT_MINUTES", None)
    return env


def test_slurm_job_refuses_an_inner_level_wider_than_a_node(tmp_path: Path) -> None:
    """TP * SAP_INNER GPUs must share a node (the inner all-to-all runs over its links)."""
    env = {**slurm_stand_ins(tmp_path), "GPUS_PER_NODE": "4", "SLURM_NTASKS_PER_NODE": "4", "TP": "2",
           "SAP_INNER": "4"}
    result = subprocess.run(["bash", str(SCRIPTS / "train_sap_slurm.sbatch")], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 1 and "TP * SAP_INNER = 2 * 4 GPUs do not fit on one node of 4 GPUs" in result.stderr
    assert not (tmp_path / "srun_args").exists()


@pytest.mark.parametrize("left, exit_minutes", [("3:59:58", "229"), ("1-00:00:00", "1430"), ("45:10", "35"),
                                                ("12:00", "6"), ("UNLIMITED", "230"), ("", "230"), (None, "90")])
def test_slurm_job_saves_before_its_own_time_limit(tmp_path: Path, left: str | None, exit_minutes: str) -> None:
    """EXIT_MINUTES follows the time the job has left when it starts (squeue's %L), 10 minutes
    short of it (half of it under 20 minutes); 230 where squeue says nothing usable; a given
    EXIT_MINUTES stays. srun, squeue and scontrol are stand-ins that record their arguments."""
    env = slurm_stand_ins(tmp_path, left)
    if left is None:
        env["EXIT_MINUTES"] = "90"
    result = subprocess.run(["bash", str(SCRIPTS / "train_sap_slurm.sbatch")], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "srun_args").read_text().splitlines()
    assert args[args.index("--exit-duration-in-mins") + 1] == exit_minutes

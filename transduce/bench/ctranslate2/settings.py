"""The ways CTranslate2 is run within the bench's thread budget (--threads), their system names
("ctranslate2-avx2"), and what each amounts to on this CPU: two settings that amount to one configuration are
timed once."""

from __future__ import annotations

import math
from dataclasses import dataclass

from transduce.bench.cpu import cpu_above_avx2, cpu_is_intel, cpuinfo


@dataclass(frozen=True)
class Ct2Setting:
    """One way of running CTranslate2 within the bench's thread budget (--threads)."""
    isa: str | None = None  # ONEDNN_MAX_CPU_ISA in the worker's environment (None: removed from it)
    mkl: str | None = None  # CT2_USE_MKL likewise (None: CTranslate2 uses MKL on Intel's CPUs only)
    one_thread: bool = False  # intra_threads 1 instead of the budget
    inter: bool = False  # the batch in parts at the same time: inter_threads = the budget, intra_threads 1

    def env(self) -> dict[str, str | None]:
        return {"ONEDNN_MAX_CPU_ISA": self.isa, "CT2_USE_MKL": self.mkl}


# Each setting is one of CTranslate2's fastest configurations on some CPU measured within the budget: one thread
# (1thread), a batch in parallel parts (inter), oneDNN in place of MKL on Intel's CPUs (nomkl), oneDNN capped at
# AVX2 (avx2). Why, with the measurements: docs/design/bench.md, "CTranslate2's settings".
CT2_SETTINGS: dict[str, Ct2Setting] = {
    "default": Ct2Setting(),
    "avx2": Ct2Setting(isa="AVX2"),
    "mkl": Ct2Setting(mkl="1"),
    "nomkl": Ct2Setting(mkl="0"),
    "1thread": Ct2Setting(one_thread=True),
    "nomkl-1thread": Ct2Setting(mkl="0", one_thread=True),
    "inter": Ct2Setting(inter=True),
    "nomkl-inter": Ct2Setting(mkl="0", inter=True),
}
DEFAULT_CT2_SETTINGS = ["default", "avx2", "1thread", "nomkl", "nomkl-1thread", "inter", "nomkl-inter"]


# CTranslate2's own int8 (compute_type int8) on the same conversion, timed beside --quantize int8 as the reference of
# that row: not one of the fp32 settings above (is_ct2 is False for it), so it is never fp32's best
CT2_INT8 = "ct2-int8"


def ct2_system_name(setting: str) -> str:
    return "ctranslate2" if setting == "default" else f"ctranslate2-{setting}"


def is_ct2(name: str) -> bool:
    return name.startswith("ctranslate2")


def ct2_setting(name: str) -> str:
    """The setting of a CTranslate2 system name ("ctranslate2-avx2" -> "avx2", "ctranslate2" -> "default")."""
    return name.split("-", 1)[1] if "-" in name else "default"


def ct2_threads(setting: str, threads: int) -> int:
    """CTranslate2's intra_threads under `setting` with a budget of `threads`."""
    s = CT2_SETTINGS[setting]
    return 1 if s.one_thread or s.inter else threads


def ct2_inter_threads(setting: str, threads: int) -> int:
    """CTranslate2's inter_threads under `setting` with a budget of `threads`."""
    return threads if CT2_SETTINGS[setting].inter else 1


def ct2_effective_env(setting: str, intel: bool, above_avx2: bool = True) -> dict[str, str | None]:
    """The environment a setting amounts to: CTranslate2 resolves an unset CT2_USE_MKL to MKL on Intel CPUs
    only (cpu/backend.cc, mayiuse_mkl); ONEDNN_MAX_CPU_ISA=AVX2 caps nothing on a CPU with no instruction set
    above AVX2 that oneDNN would use (above_avx2 False: the variable amounts to being unset)."""
    env = CT2_SETTINGS[setting].env()
    if env["CT2_USE_MKL"] is None:
        env["CT2_USE_MKL"] = "1" if intel else "0"
    if env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and not above_avx2:
        env["ONEDNN_MAX_CPU_ISA"] = None
    return env


def ct2_cpu(intel: bool | None = None, above_avx2: bool | None = None) -> tuple[bool, bool]:
    """(an Intel CPU, an instruction set above AVX2): what ct2_effective_env needs, the values not given read
    from /proc/cpuinfo, once for both."""
    if intel is None or above_avx2 is None:
        info = cpuinfo()
        intel = cpu_is_intel(info) if intel is None else intel
        above_avx2 = cpu_above_avx2(info) if above_avx2 is None else above_avx2
    return intel, above_avx2


def ct2_configuration(setting: str, threads: int, cpu: tuple[bool, bool], batch: int | None = None) -> tuple:
    """What `setting` amounts to on this CPU (cpu: ct2_cpu()) with a budget of `threads`: its effective
    environment, intra_threads, and inter_threads, or with a batch the sub-batches decoded at once. Two
    settings with one configuration would time the same thing twice."""
    env = ct2_effective_env(setting, *cpu)
    parallel = ct2_inter_threads(setting, threads) if batch is None else ct2_sub_batches(setting, threads, batch)
    return tuple(sorted(env.items())), ct2_threads(setting, threads), parallel


def ct2_settings_run(settings: list[str], threads: int, intel: bool | None = None,
                     above_avx2: bool | None = None) -> list[str]:
    """The settings timed: those that would only repeat another's configuration at this budget are left
    out (1thread and inter at --threads 1 are the default setting; nomkl is the default on a CPU that is not
    Intel's; avx2 is the default on a CPU with nothing above AVX2). Timing a configuration twice would only
    let the faster of two identical runs, noise, stand as CTranslate2's best."""
    cpu = ct2_cpu(intel, above_avx2)
    seen: set[tuple] = set()
    out: list[str] = []
    for s in settings:
        key = ct2_configuration(s, threads, cpu)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def ct2_sub_batches(setting: str, threads: int, batch: int) -> int:
    """How many sub-batches CTranslate2 decodes at the same time under `setting` for `batch` sentences: an inter
    setting splits the batch into parts of ceil(batch / inter_threads) (bench/worker.py), so a batch of one
    sentence is one sub-batch on one thread, whatever inter_threads says."""
    inter = ct2_inter_threads(setting, threads)
    return 1 if inter == 1 else min(inter, math.ceil(batch / math.ceil(batch / inter)))


def ct2_cell_repeats(names: list[str], threads: int, batch: int, intel: bool | None = None,
                     above_avx2: bool | None = None) -> dict[str, str]:
    """The CTranslate2 systems (of those timed in the run, in order) that would repeat an earlier one's
    configuration (ct2_configuration) in a cell of `batch` sentences -> {system: the one it repeats}. At batch 1
    an inter setting is its one-thread counterpart (one sub-batch, intra_threads 1): timing both would let the
    faster of two identical runs, noise, stand as CTranslate2's best (ct2_settings_run does the same for the
    whole run)."""
    cpu = ct2_cpu(intel, above_avx2)
    first: dict[tuple, str] = {}
    out: dict[str, str] = {}
    for n in names:
        if is_ct2(n):
            key = ct2_configuration(ct2_setting(n), threads, cpu, batch)
            if key in first:
                out[n] = first[key]
            else:
                first[key] = n
    return out

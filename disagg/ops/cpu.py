"""What this CPU can run, asked of it once per process: the instruction set level of the csrc
kernels, oneDNN's bfloat16 path, native bfloat16 and VNNI. Every capability check of the engine
reads it from here, so that no path is chosen that the CPU would refuse.

`DISAGG_CPU_ISA=avx2` (or `base`; disagg.config.cpu_isa) caps every answer at that level on any CPU
that has it: a machine with AVX-512 then runs the csrc kernels of the avx2 build and answers "no" for
oneDNN's bfloat16 and native bfloat16, as an AVX2-only CPU would. torch's own libraries pick their code
from the hardware; `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2` hold
them to the same level (`make test` sets all four for its second pass over the engine and ops tests, as
printed by `python -m disagg.ops cpu lesser`; docs/engine.md).
"""

from __future__ import annotations

import enum
import functools
import pathlib
from dataclasses import dataclass

import torch

from disagg.config import ConfigError, cpu_isa


class Isa(enum.Enum):
    """An instruction set level of the csrc kernels (one build of each; csrc/cpu/ops.cpp), best first."""

    AVX512 = "avx512"
    AVX2 = "avx2"
    BASE = "base"

    @property
    def rank(self) -> int:
        """0 for base, higher is more."""
        return len(Isa) - 1 - list(Isa).index(self)


# The flags (Linux's /proc/cpuinfo names) each level needs: what csrc's cpu_has asks of the CPU.
ISA_FLAGS = {
    Isa.AVX512: frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma"}),
    Isa.AVX2: frozenset({"avx2", "fma"}),
    Isa.BASE: frozenset(),
}
# Flags a CPU capped at AVX2 no longer has (every AVX-512 and AMX extension), and those a CPU capped
# at base lacks beyond them (the VEX-encoded extensions that came with or after AVX2).
_AVX2_EXTENSIONS = frozenset({"avx2", "fma", "f16c", "avx_vnni", "avx_vnni_int8", "avx_ne_convert", "avx_ifma"})
# oneDNN packs and multiplies bfloat16 weights only with these (else it raises "bf16 path needs the cpu
# support avx_ne_convert or avx512bw, avx512vl and avx512dq").
_ONEDNN_BF16_FLAGS = frozenset({"avx512bw", "avx512vl", "avx512dq"})


def _above(flag: str, isa: Isa) -> bool:
    if flag.startswith(("avx512", "amx")):
        return isa is not Isa.AVX512
    return flag in _AVX2_EXTENSIONS and isa is Isa.BASE


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's flags and the instruction set level in force (`isa`): the hardware's, or lower where
    DISAGG_CPU_ISA caps it (`capped`); `flags` are then those a CPU of that level would have."""

    hardware_isa: Isa
    isa: Isa
    flags: frozenset[str]
    capped: bool = False

    @property
    def onednn_bf16(self) -> bool:
        """oneDNN's bfloat16 reorder and linear run here."""
        return _ONEDNN_BF16_FLAGS <= self.flags or "avx_ne_convert" in self.flags

    @property
    def native_bf16(self) -> bool:
        """bfloat16 dot products in hardware (AVX512_BF16 or AMX): bfloat16 is then the fast dtype."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags

    @property
    def vnni(self) -> bool:
        """int8 dot products in one instruction (AVX512_VNNI or AVX_VNNI)."""
        return "avx512_vnni" in self.flags or "avx_vnni" in self.flags

    def describe(self) -> str:
        """'avx2 (DISAGG_CPU_ISA; the hardware runs avx512): no oneDNN bf16, no native bf16, no VNNI', for
        the ready line."""
        where = f" (DISAGG_CPU_ISA; the hardware runs {self.hardware_isa.value})" if self.capped else ""
        has = [("oneDNN bf16", self.onednn_bf16), ("native bf16", self.native_bf16), ("VNNI", self.vnni)]
        return f"{self.isa.value}{where}: " + ", ".join(name if ok else f"no {name}" for name, ok in has)


def features_of(flags: frozenset[str], cap: str | None = None) -> CpuFeatures:
    """The features of a CPU with `flags`, capped at the level `cap` names (ConfigError when the CPU
    lacks that level: an AVX2 machine cannot run as AVX-512)."""
    hardware = next(isa for isa in Isa if ISA_FLAGS[isa] <= flags)
    if cap is None:
        return CpuFeatures(hardware, hardware, flags)
    isa = Isa(cap)
    if isa.rank > hardware.rank:
        raise ConfigError(f"DISAGG_CPU_ISA={cap}: this CPU runs {hardware.value} at most "
                          f"(it lacks {', '.join(sorted(ISA_FLAGS[isa] - flags))})")
    return CpuFeatures(hardware, isa, frozenset(f for f in flags if not _above(f, isa)), capped=isa is not hardware)


def read_flags(cpuinfo: pathlib.Path = pathlib.Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags: Linux's list, else (another OS) what torch's own probes answer."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    probes = {"avx2": torch.cpu._is_avx2_supported, "fma": torch.cpu._is_avx2_supported,
              "avx512f": torch.cpu._is_avx512_supported, "avx512bw": torch.cpu._is_avx512_supported,
              "avx512vl": torch.cpu._is_avx512_supported, "avx512dq": torch.cpu._is_avx512_supported,
              "avx512_vnni": torch.cpu._is_vnni_supported, "avx512_bf16": torch.cpu._is_avx512_bf16_supported}
    return frozenset(flag for flag, probe in probes.items() if probe())


@functools.cache
def cpu_features() -> CpuFeatures:
    """This process's CPU features (read once; DISAGG_CPU_ISA applied)."""
    return features_of(read_flags(), cpu_isa())


# torch's own settings that hold ATen's vectorised code, oneDNN and MKL (float32 matmul: HF's side of a
# benchmark) to a level (their names for it). MKL held to AVX2 on an AVX-512 Xeon core: sgemm 114 GFLOP/s
# against 184 (512 x 576 x 1536, one thread).
TORCH_LEVELS = {Isa.AVX512: ("avx512", "AVX512_CORE", "AVX512"), Isa.AVX2: ("avx2", "AVX2", "AVX2"),
                Isa.BASE: ("default", "SSE41", "SSE4_2")}
TORCH_LEVEL_VARS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def lesser_env(features: CpuFeatures) -> dict[str, str]:
    """The environment that runs this process's code as the level below `features.isa` (avx512 → avx2,
    avx2 → base): DISAGG_CPU_ISA and TORCH_LEVEL_VARS; empty at base."""
    if features.isa is Isa.BASE:
        return {}
    lesser = list(Isa)[list(Isa).index(features.isa) + 1]
    return {"DISAGG_CPU_ISA": lesser.value, **dict(zip(TORCH_LEVEL_VARS, TORCH_LEVELS[lesser]))}


def main(argv: list[str]) -> int:
    """`python -m disagg.ops cpu`: what this CPU runs; with `lesser`, the settings of the level below as
    `NAME=value` words for `env` (nothing at base)."""
    features = cpu_features()
    if argv == ["lesser"]:
        print(" ".join(f"{name}={value}" for name, value in lesser_env(features).items()))
    else:
        print(features.describe())
    return 0

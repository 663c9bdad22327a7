"""disagg.ops.cpu: what a CPU runs, from its flags, and DISAGG_CPU_ISA capping it at a lesser level."""

from __future__ import annotations

import pytest

from disagg.config import ConfigError, cpu_isa
from disagg.ops.cpu import CpuFeatures, Isa, features_of, lesser_env, read_flags

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})  # a 2-core cloud EPYC's vector flags
SKYLAKE_X = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}  # AVX-512 without VNNI
SAPPHIRE = SKYLAKE_X | {"avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile"}


def test_the_level_is_the_best_whose_flags_the_cpu_has():
    assert features_of(AVX2) == CpuFeatures(Isa.AVX2, Isa.AVX2, AVX2)
    assert features_of(SKYLAKE_X).isa is Isa.AVX2  # csrc's avx512 build needs VNNI
    assert features_of(SAPPHIRE).isa is Isa.AVX512
    assert features_of(frozenset({"sse2", "avx"})).isa is Isa.BASE
    assert [isa.rank for isa in Isa] == [2, 1, 0]


def test_what_each_cpu_offers():
    avx2, skx, spr = features_of(AVX2), features_of(SKYLAKE_X), features_of(SAPPHIRE)
    assert (avx2.onednn_bf16, avx2.native_bf16, avx2.vnni) == (False, False, False)
    assert (skx.onednn_bf16, skx.native_bf16, skx.vnni) == (True, False, False)
    assert (spr.onednn_bf16, spr.native_bf16, spr.vnni) == (True, True, True)
    assert features_of(AVX2 | {"avx_ne_convert", "avx_vnni"}).onednn_bf16  # oneDNN's other bf16 route
    assert avx2.describe() == "avx2: no oneDNN bf16, no native bf16, no VNNI"
    assert spr.describe() == "avx512: oneDNN bf16, native bf16, VNNI"


def test_a_cap_answers_as_a_cpu_of_that_level():
    capped = features_of(SAPPHIRE, "avx2")
    assert (capped.hardware_isa, capped.isa, capped.capped) == (Isa.AVX512, Isa.AVX2, True)
    assert capped.flags == AVX2  # every AVX-512 and AMX extension gone
    assert capped.describe() == ("avx2 (DISAGG_CPU_ISA; the hardware runs avx512): "
                                 "no oneDNN bf16, no native bf16, no VNNI")
    base = features_of(SAPPHIRE, "base")
    assert (base.isa, base.flags) == (Isa.BASE, frozenset({"sse4_2", "avx"}))
    assert features_of(AVX2, "avx2") == features_of(AVX2)  # the hardware's own level: not capped


def test_avx_vnni_stays_under_an_avx2_cap():
    flags = SAPPHIRE | {"avx_vnni"}
    assert features_of(flags, "avx2").vnni and not features_of(flags, "base").vnni


def test_a_cap_above_the_hardware_is_refused():
    with pytest.raises(ConfigError) as err:
        features_of(AVX2, "avx512")
    assert str(err.value) == ("DISAGG_CPU_ISA=avx512: this CPU runs avx2 at most "
                              "(it lacks avx512_vnni, avx512bw, avx512dq, avx512f, avx512vl)")


def test_the_environment_variable():
    assert cpu_isa({}) is None and cpu_isa({"DISAGG_CPU_ISA": ""}) is None
    assert cpu_isa({"DISAGG_CPU_ISA": " AVX2 "}) == "avx2"
    with pytest.raises(ConfigError) as err:
        cpu_isa({"DISAGG_CPU_ISA": "sse"})
    assert str(err.value) == "DISAGG_CPU_ISA must be one of avx512, avx2, base, got 'sse'"


def test_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\n")
    assert read_flags(cpuinfo) == frozenset({"fpu", "avx2", "fma"})


def test_the_lesser_level_sets_torchs_own_limits_too():
    assert lesser_env(features_of(SAPPHIRE)) == {
        "DISAGG_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert lesser_env(features_of(AVX2)) == {
        "DISAGG_CPU_ISA": "base", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
    assert lesser_env(features_of(SAPPHIRE, "base")) == {}

"""The bundled llama-server (proxy/bundled.py): build flavours, verification on this CPU, the
fallback to the safe baseline when a build dies, and exits reported in words.

The fallback tests run the real llama-server (the one `make test` builds and caches; built here
first if it is missing) with the real model: only the failing first build is a stand-in, a shell
script that kills itself with SIGILL as a binary built for a missing CPU feature does.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy import bundled
from proxy.bundled import X86_AVX2, X86_BASELINE, Flavour, SetupError

# What a typical AVX2 machine lists (plus features no flavour may use: AVX-512, AMX).
AVX2_FLAGS = frozenset(
    {"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c"}
    | {"bmi1", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    | {"amx_tile", "amx_int8", "amx_bf16"}
)
AMX_INSTRUCTIONS = re.compile(
    r"\b(tilezero|tileloadd|tileloaddt1|tilestored|tilerelease|ldtilecfg|sttilecfg|"
    r"tdpbssd|tdpbsud|tdpbusd|tdpbuud|tdpbf16ps|tdpfp16ps)\b"
)
ZMM_REGISTER = re.compile(r"%zmm\d")
OPMASK_REGISTER = re.compile(r"%k[0-7]\b")  # AVX-512 mask registers
YMM_REGISTER = re.compile(r"%ymm\d")
SIGILL_SCRIPT = "#!/bin/sh\nulimit -c 0\nkill -ILL $$\n"


def write_sigill_binary(path: Path) -> Path:
    """A stand-in for a llama-server built for a CPU feature this machine does not allow."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SIGILL_SCRIPT)
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def real_binary() -> Path:
    """The real llama-server for this machine, from the normal cache (what `make test` builds;
    about 6 minutes on 2 cores if it is not there yet)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(bundled.BINARY_ENV, raising=False)
        return bundled.ensure_built()


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cache root: every build and record of the test goes there."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(bundled.BINARY_ENV, raising=False)
    yield bundled.cache_root()


def no_build(flavour: Flavour, target: Path) -> None:
    raise AssertionError(f"{flavour.name} must not be built")


# --- pure: flavours and words ------------------------------------------------------------------


def test_avx2_machine_gets_avx2_then_baseline() -> None:
    assert bundled.candidate_flavours("x86_64", AVX2_FLAGS) == (X86_AVX2, X86_BASELINE)
    assert bundled.candidate_flavours("AMD64", AVX2_FLAGS) == (X86_AVX2, X86_BASELINE)


@pytest.mark.parametrize("missing", ["avx2", "fma", "f16c", "bmi2", "avx", "sse4_2"])
def test_x86_machine_missing_a_feature_gets_only_the_baseline(missing: str) -> None:
    assert bundled.candidate_flavours("x86_64", AVX2_FLAGS - {missing}) == (X86_BASELINE,)


def test_x86_machine_without_cpuinfo_gets_the_baseline() -> None:
    assert bundled.candidate_flavours("x86_64", frozenset()) == (X86_BASELINE,)


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "riscv64", "ppc64le"])
def test_other_architectures_get_one_portable_flavour(machine: str) -> None:
    flavours = bundled.candidate_flavours(machine, AVX2_FLAGS | {"asimd", "sve"})
    assert len(flavours) == 1
    assert flavours[0].name == f"{machine}-portable"
    assert flavours[0].cmake_options == ("-DGGML_NATIVE=OFF",)


def all_flavours() -> list[Flavour]:
    return [X86_AVX2, X86_BASELINE, bundled.portable_flavour("aarch64")]


@pytest.mark.parametrize("flavour", all_flavours(), ids=lambda f: f.name)
def test_no_flavour_is_native_or_uses_avx512_or_amx(flavour: Flavour) -> None:
    options = [*bundled.CMAKE_OPTIONS, *flavour.cmake_options]
    assert [o for o in options if o.startswith("-DGGML_NATIVE=")] == ["-DGGML_NATIVE=OFF"]
    on = {o.removeprefix("-DGGML_").removesuffix("=ON") for o in options if o.endswith("=ON")}
    assert not {o for o in on if o.startswith(("AVX512", "AMX", "AVX_VNNI"))}, on
    assert not any("march" in o or "native" in o.lower().split("=")[-1] for o in options)


def test_x86_flavours_set_every_instruction_set_option_explicitly() -> None:
    # With GGML_NATIVE=OFF ggml turns SSE42/AVX/AVX2/BMI2/FMA/F16C on by default.
    for flavour in (X86_AVX2, X86_BASELINE):
        named = {o.split("=")[0].removeprefix("-DGGML_") for o in flavour.cmake_options}
        assert set(bundled.X86_OPTIONS) <= named
    avx2_on = {o for o in X86_AVX2.cmake_options if o.endswith("=ON")}
    assert avx2_on == {
        f"-DGGML_{name}=ON" for name in ("SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C")
    }
    assert not [o for o in X86_BASELINE.cmake_options if o.endswith("=ON")]


def test_flavours_have_their_own_cache_folder(tmp_cache: Path) -> None:
    for flavour in all_flavours():
        path = bundled.flavour_binary(flavour)
        assert path == tmp_cache / bundled.LLAMA_CPP_PYTHON_VERSION / flavour.name / "llama-server"


def test_describe_exit_in_words() -> None:
    assert bundled.describe_exit(-signal.SIGILL) == (
        "illegal instruction: built for a CPU feature this machine does not allow"
    )
    assert "segmentation fault" in bundled.describe_exit(-signal.SIGSEGV)
    assert bundled.describe_exit(-signal.SIGKILL) == "killed by SIGKILL (out of memory?)"
    assert bundled.describe_exit(-signal.SIGTERM).startswith("killed by SIGTERM")
    assert bundled.describe_exit(-signal.SIGABRT).startswith("killed by SIGABRT")
    assert bundled.describe_exit(1) == "exit status 1"
    assert bundled.describe_exit(0) == "exit status 0"
    for code in (-signal.SIGILL, -signal.SIGSEGV, -signal.SIGKILL, -signal.SIGTERM, -200):
        assert str(code) not in bundled.describe_exit(code)


# --- the fallback, with the real binary and the real model --------------------------------------


def test_a_build_that_dies_with_sigill_falls_back_to_the_safe_baseline(
    tmp_cache: Path, real_binary: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    built: list[str] = []

    def builder(flavour: Flavour, target: Path) -> None:
        built.append(flavour.name)
        if flavour == X86_AVX2:
            write_sigill_binary(target)
        else:
            shutil.copy2(real_binary, target)

    flavours = (X86_AVX2, X86_BASELINE)
    path = bundled.ensure_built(build_fn=builder, flavours=flavours)

    assert path == bundled.flavour_binary(X86_BASELINE)
    assert built == ["x86_64-avx2", "x86_64-baseline"]
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "rebuilding with the safe baseline" in line]
    assert said, err
    assert "x86_64-baseline" in said[0]
    assert "illegal instruction: built for a CPU feature this machine does not allow" in said[0]
    assert "smoke test passed" in err  # the baseline answered a real chat request
    assert "exited with status -4" not in err
    # the failed flavour is recorded for this CPU, not cached; the baseline is verified here
    reason = bundled.failure_here(X86_AVX2)
    assert reason is not None and "illegal instruction" in reason
    assert not bundled.flavour_binary(X86_AVX2).exists()
    assert bundled.is_verified(path)
    assert not list(path.parent.parent.glob("*/.llama-server.*"))  # no staged leftovers

    # a second call neither rebuilds nor retries the failed flavour
    again = bundled.ensure_built(build_fn=builder, flavours=flavours)
    assert again == path
    assert built == ["x86_64-avx2", "x86_64-baseline"]
    assert "illegal instruction" not in capsys.readouterr().err

    # and the binary it returned answers a real chat request
    reply = bundled.smoke_test(path)
    assert isinstance(reply, str)


def test_a_cached_binary_not_yet_run_on_this_cpu_is_tested_first(
    tmp_cache: Path, real_binary: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A home directory shared between machines: verified elsewhere is not verified here."""
    target = bundled.flavour_binary(X86_BASELINE)
    target.parent.mkdir(parents=True)
    shutil.copy2(real_binary, target)
    bundled.verified_file(target).write_text("0123456789ab\t2025-01-01 another CPU\n")
    assert not bundled.is_verified(target)
    assert bundled.binary_path() is None

    path = bundled.ensure_built(build_fn=no_build, flavours=(X86_BASELINE,))

    assert path == target
    assert bundled.is_verified(target)
    assert bundled.is_verified(target, "0123456789ab")  # the other CPU's record is kept
    err = capsys.readouterr().err
    assert "has not run on this CPU yet" in err
    assert "smoke test passed" in err


def test_a_cached_binary_that_dies_here_falls_back_to_the_baseline(
    tmp_cache: Path, real_binary: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    avx2 = write_sigill_binary(bundled.flavour_binary(X86_AVX2))
    bundled.verified_file(avx2).write_text("0123456789ab\t2025-01-01 another CPU\n")

    def builder(flavour: Flavour, target: Path) -> None:
        assert flavour == X86_BASELINE
        shutil.copy2(real_binary, target)

    path = bundled.ensure_built(build_fn=builder, flavours=(X86_AVX2, X86_BASELINE))

    assert path == bundled.flavour_binary(X86_BASELINE)
    assert avx2.is_file()  # it still works on the CPU that verified it
    assert "illegal instruction" in (bundled.failure_here(X86_AVX2) or "")
    assert "rebuilding with the safe baseline x86_64-baseline" in capsys.readouterr().err


def test_when_every_flavour_fails_the_error_says_why_and_it_is_not_retried(
    tmp_cache: Path,
) -> None:
    built: list[str] = []

    def builder(flavour: Flavour, target: Path) -> None:
        built.append(flavour.name)
        write_sigill_binary(target)

    with pytest.raises(SetupError, match="illegal instruction") as first:
        bundled.ensure_built(build_fn=builder, flavours=(X86_BASELINE,))
    assert "no llama-server build works on this CPU" in str(first.value)
    assert str(bundled.failed_file(X86_BASELINE)) in str(first.value)
    with pytest.raises(SetupError, match="illegal instruction"):
        bundled.ensure_built(build_fn=builder, flavours=(X86_BASELINE,))
    assert built == ["x86_64-baseline"]


def test_smoke_test_reports_a_crash_in_words(tmp_path: Path) -> None:
    binary = write_sigill_binary(tmp_path / "llama-server")
    with pytest.raises(bundled.SmokeTestFailed) as failed:
        bundled.smoke_test(binary)
    assert failed.value.reason.startswith(
        "illegal instruction: built for a CPU feature this machine does not allow"
    )
    # No raw signal number (the binary's path, a pytest folder like pytest-40, may hold "-4").
    assert "-4" not in failed.value.reason.replace(str(binary), "<binary>")


# --- the real build ----------------------------------------------------------------------------


def test_the_real_build_was_smoke_tested_on_this_cpu(real_binary: Path) -> None:
    flavours = bundled.candidate_flavours()
    expected = next(f for f in flavours if bundled.failure_here(f) is None)
    assert real_binary == bundled.flavour_binary(expected)
    assert bundled.is_verified(real_binary)
    assert bundled.cpu_tag() in bundled.verified_file(real_binary).read_text()
    assert bundled.binary_path() == real_binary


def test_the_real_build_has_no_amx_or_avx512_instructions(real_binary: Path) -> None:
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed: cannot disassemble llama-server")
    amx: list[str] = []
    zmm: list[str] = []
    opmask: list[str] = []
    ymm = 0
    with subprocess.Popen(
        [objdump, "-d", "--no-show-raw-insn", str(real_binary)],
        stdout=subprocess.PIPE,
        text=True,
        errors="replace",
    ) as proc:
        assert proc.stdout is not None
        lines = 0
        for line in proc.stdout:
            lines += 1
            if AMX_INSTRUCTIONS.search(line):
                amx.append(line.strip())
            if ZMM_REGISTER.search(line):
                zmm.append(line.strip())
            if OPMASK_REGISTER.search(line):
                opmask.append(line.strip())
            if YMM_REGISTER.search(line):
                ymm += 1
    assert proc.returncode == 0
    assert lines > 100_000  # really disassembled
    assert not amx, amx[:10]
    assert not zmm, zmm[:10]
    assert not opmask, opmask[:10]
    # and the flavour is what its name says: AVX2 code in the avx2 build, none in the baseline
    if real_binary.parent.name == X86_AVX2.name:
        assert ymm > 1000, ymm
    elif real_binary.parent.name == X86_BASELINE.name:
        assert ymm == 0, ymm


# --- as Engram's upstream ----------------------------------------------------------------------


@pytest.mark.asyncio
async def test_start_upstream_says_illegal_instruction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = write_sigill_binary(tmp_path / "llama-server")
    monkeypatch.setenv(bundled.BINARY_ENV, str(binary))
    with pytest.raises(SetupError, match="illegal instruction") as raised:
        await bundled.start_upstream(ready_timeout=30)
    assert "status -4" not in str(raised.value)

"""keras_mone.host_memory: with huge pages a repeated large allocation stops page-faulting 4 KB at a
time, and the command line restarts itself with them."""

import json
import os
import subprocess
import sys

import pytest

from keras_mone import host_memory

# Allocates, touches and frees a 64 MB block 10 times on a worker thread (as XLA does
# with a step's temporaries) and reports the minor page faults of those rounds.
PROBE = """
import ctypes, json, resource, threading
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
size = 64 * 2**20
faults = []

def rounds():
    block = libc.malloc(size); ctypes.memset(block, 1, size); libc.free(block)  # first touch: faults either way
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

worker = threading.Thread(target=rounds)
worker.start(); worker.join()
print(json.dumps(faults[0]))
"""
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's tunables: Linux only")


def transparent_huge_pages():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def glibc_with_hugetlb():  # the tunable exists from glibc 2.35
    import platform

    name, version = platform.libc_ver()
    return name == "glibc" and tuple(int(p) for p in version.split(".")[:2]) >= (2, 35)


def faults(environ):
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, env=environ).stdout
    return json.loads(out.strip().splitlines()[-1])


def without_settings():
    return {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", host_memory.ENVIRONMENT_SWITCH)}


# Maps one 64 MB block and reports what /proc/self/smaps says of its mapping: whether glibc
# asked for huge pages (THPeligible, set by its madvise) and how much the kernel granted.
MAPPING_PROBE = """
import ctypes, json
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
block = libc.malloc(64 * 2**20); ctypes.memset(block, 1, 64 * 2**20)
found, inside = {}, False
with open("/proc/self/smaps") as f:
    for line in f:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= block < high
        elif inside and head in ("THPeligible:", "AnonHugePages:"):
            found[head[:-1]] = int(line.split()[1])
libc.free(block)
print(json.dumps(found))
"""
HUGE_PAGES = pytest.mark.skipif(not (transparent_huge_pages() and glibc_with_hugetlb()),
                                reason="needs THP and glibc >= 2.35")


def mapping(environ):
    out = subprocess.run([sys.executable, "-c", MAPPING_PROBE], capture_output=True, text=True, check=True,
                         env=environ).stdout
    return json.loads(out.strip().splitlines()[-1])


@HUGE_PAGES
def test_the_setting_asks_the_kernel_for_huge_pages():
    """Exact: with the tunable glibc marks a large block's mapping for huge pages; without it, not
    (when THP is ``always`` every mapping is eligible, so only the "with" half is checked)."""
    assert mapping(host_memory.with_huge_pages(without_settings()))["THPeligible"] == 1
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[madvise]" in f.read():
            assert mapping(without_settings())["THPeligible"] == 0


@HUGE_PAGES
def test_huge_pages_stop_the_page_faults_of_a_repeated_large_block():
    """Faults drop from one per 4 KB page to a few per 2 MB page. How many huge pages the kernel
    can grant depends on its free memory's fragmentation (a loaded CI machine granted 97% of them,
    an idle one 99.8%), so the check asks for a 10x drop, not for every page."""
    pages = 10 * 64 * 2**20 // 4096
    plain = faults(without_settings())
    assert plain > 0.5 * pages  # unmapped at every free, faulted in again 4 KB at a time
    assert faults(host_memory.with_huge_pages(without_settings())) < 0.1 * plain


def test_the_tunable_joins_other_tunables():
    environ = host_memory.with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0:glibc.pthread.rseq=0"})
    assert environ["GLIBC_TUNABLES"] == "glibc.pthread.rseq=0:glibc.malloc.hugetlb=1"
    assert host_memory.has_huge_pages(environ) and host_memory.with_huge_pages(environ) == environ


def restarted_environment(**extra):
    """What a process restarted by ``restart_with_huge_pages`` sees."""
    script = (
        "import json, os, sys\n"
        "from keras_mone.host_memory import has_huge_pages, restart_with_huge_pages\n"
        "if len(sys.argv) == 1:\n"
        "    restart_with_huge_pages([sys.executable, '-c', SCRIPT, 'restarted'])\n"
        "print(json.dumps({'restarted': sys.argv[1:] == ['restarted'], 'huge_pages': has_huge_pages()}))\n"
    )
    script = script.replace("SCRIPT", repr(script.replace("SCRIPT", "''")))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         env={**without_settings(), **extra}).stdout
    return json.loads(out.strip().splitlines()[-1])


@LINUX
def test_restart_sets_the_environment_once_and_the_switch_turns_it_off():
    assert restarted_environment() == {"restarted": True, "huge_pages": True}
    assert restarted_environment(GLIBC_TUNABLES=host_memory.TUNABLE) == {"restarted": False, "huge_pages": True}
    assert restarted_environment(KERAS_MONE_HUGE_PAGES="0") == {"restarted": False, "huge_pages": False}


def test_only_the_computing_keras_mone_subcommands_restart(monkeypatch):
    restart = host_memory.restart_command_with_huge_pages
    assert not restart(["/usr/bin/python", "quickstart"])  # not the keras-mone command
    assert not restart(["/home/me/main.py", "train"])  # someone's own script
    assert not restart(["/venv/bin/keras-mone", "presets", "list"])  # nothing to compute
    assert not restart(["/venv/bin/keras-mone"])
    assert not host_memory.restart_subcommand_with_huge_pages(["presets", "list"])
    monkeypatch.setenv(host_memory.ENVIRONMENT_SWITCH, "0")
    assert not restart(["/venv/bin/keras-mone", "train", "cluttered_digits_vit"])  # opted out

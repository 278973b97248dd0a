"""Host memory for CPU runs: transparent huge pages for the backend's large blocks.

XLA on CPU gives every call of a compiled step a fresh temporary buffer
(about 280 MB for the training step of the digits ViT, batch 128). glibc
``mmap``-s a block that large and unmaps it when freed, so every step
page-faults all of it in again, 4 KB at a time: 72,000 minor faults and 120
ms of system time per 170 ms step on 2 CPU cores (BENCHMARKS.md "Host memory:
huge pages for large blocks", ``bench/host_memory.py``). With glibc's tunable
``glibc.malloc.hugetlb=1`` (glibc 2.35 and later) malloc asks the kernel for
transparent huge pages on those blocks (``madvise``), and the same buffer
faults in as about 140 pages of 2 MB. Nothing else about memory changes:
freed blocks still go back to the OS. (Keeping them instead, with one malloc
arena and no ``mmap``, removed the faults as well but made MoNE's forward
pass slower: the backend's threads then contend for the one arena.)

glibc reads tunables from the environment when a process starts, so this is
an environment variable, not a call: ``keras-mone quickstart / train / bench /
analyze`` restart themselves once with it (:func:`restart_with_huge_pages`;
opt out with ``KERAS_MONE_HUGE_PAGES=0``); a Python program gets it by
starting with it set (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python
train.py``). Without transparent huge pages in the kernel (``never`` in
``/sys/kernel/mm/transparent_hugepage/enabled``) or with another C library it
changes nothing.
"""

import os
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
COMPUTING_SUBCOMMANDS = ("quickstart", "train", "bench", "analyze")  # keras-mone subcommands that restart
ENVIRONMENT_SWITCH = "KERAS_MONE_HUGE_PAGES"


def has_huge_pages(environ=None):
    """Whether a process with environment ``environ`` (default: this one's) starts with :data:`TUNABLE`."""
    environ = os.environ if environ is None else environ
    return TUNABLE in environ.get("GLIBC_TUNABLES", "").split(":")


def with_huge_pages(environ):
    """``environ`` with :data:`TUNABLE` added to its ``GLIBC_TUNABLES`` (other tunables kept)."""
    if has_huge_pages(environ):
        return dict(environ)
    tunables = [t for t in environ.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.hugetlb=")]
    return {**environ, "GLIBC_TUNABLES": ":".join(tunables + [TUNABLE])}


def restart_with_huge_pages(command):
    """Replaces this process by ``command`` (an argv list, e.g. the same command
    line) with :data:`TUNABLE` in its environment, unless it already has it,
    the platform is not Linux, or ``KERAS_MONE_HUGE_PAGES=0``; then returns
    False and the caller goes on. Where the system refuses the restart (an
    ``OSError`` from ``execve``, e.g. a sandbox that forbids it), one line on
    stderr says so and it returns False: the command runs in place, without
    huge pages. Call it before any work: the process is replaced."""
    if os.environ.get(ENVIRONMENT_SWITCH, "1") == "0" or not sys.platform.startswith("linux") or has_huge_pages():
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(command[0], command, with_huge_pages(os.environ))
    except OSError as error:
        reason = error.strerror or str(error) or type(error).__name__
        print(
            f"keras-mone: could not restart with GLIBC_TUNABLES={TUNABLE} ({type(error).__name__}: {reason}); "
            f"running in place without huge pages (set {ENVIRONMENT_SWITCH}=0 to skip the restart).",
            file=sys.stderr,
        )
        return False


def restart_command_with_huge_pages(argv=None):
    """For the ``keras-mone`` console script (``argv[0]``, default ``sys.argv``)
    running a computing subcommand: :func:`restart_subcommand_with_huge_pages`.
    ``keras_mone/__init__`` calls it before anything imports Keras, so the
    restart costs no Keras import; any other program: False."""
    argv = sys.argv if argv is None else argv
    if not argv or os.path.basename(argv[0]) != "keras-mone":
        return False
    # The same script again (not `-m`, which would put the working directory on sys.path).
    return restart_subcommand_with_huge_pages(argv[1:], script=argv[0])


def restart_subcommand_with_huge_pages(arguments, script=None):
    """``python SCRIPT *arguments`` (``script`` None: ``python -m
    keras_mone.cli.main *arguments``) with :data:`TUNABLE`
    (:func:`restart_with_huge_pages`) when ``arguments[0]`` is one of
    :data:`COMPUTING_SUBCOMMANDS`, else False."""
    if not arguments or arguments[0] not in COMPUTING_SUBCOMMANDS:
        return False
    entry = [script] if script else ["-m", "keras_mone.cli.main"]
    return restart_with_huge_pages([sys.executable, *entry, *arguments])

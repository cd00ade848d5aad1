"""Running a verl run script with nothing external executed, to read the launch it would run.

Why a script is resolved by running it: batch sizes come from `$((...))` arithmetic, paths from
`${VAR:-default}`, names from `$(basename ...)`; only bash evaluates those exactly as bash does.
The script runs with nothing external ever executed:
- `PATH` is an empty directory, so every external command (the launch itself, `mkdir`, `rm`,
  `curl`, `ray`, ...) is not found and goes to `command_not_found_handle`, which writes its
  arguments (NUL-separated, tagged with its process id, in small appended pieces so that the
  commands of one pipeline do not interleave) to an inherited file descriptor and returns 0;
- the script runs in restricted mode (`set -r` once the stand-ins below are defined), which
  refuses commands named by a path (`/bin/rm`), output redirections to files and `exec`: the one
  way around an empty PATH, and the one way a builtin could write a file;
- bash functions stand in for the utilities scripts call inside `$(...)`: `basename` and
  `dirname` (parameter expansion), `date` (a fixed string), `nproc` (8), `realpath`/`readlink`
  (their argument), `nvidia-smi` (nothing). `cd`/`pwd` keep a virtual working directory that
  starts at the caller's; `source FILE` reads FILE and evaluates it in the same sandbox; `exec CMD`
  runs CMD (the handler) and exits; `set` drops errexit (`-e`), so that a refused redirection does
  not stop the script before its launch; SIGPIPE is ignored, so that `launch | tee log` records the
  launch even when the `tee` stand-in has already gone;
- HOME is an empty temporary directory and the process runs in another one, with stdin from
  /dev/null and a 10 s timeout; the caller's environment (e.g. NUM_GPUS=4) is passed through, so
  `${NUM_GPUS:-8}` resolves as it would for them. In the recorded command lines the temporary HOME
  is replaced by the caller's HOME, so `$HOME/data/x.parquet` reads as the script meant.
Limits of that: `${BASH_SOURCE[0]}` is the script's file name alone (`$0` is its path), `set --
...` inside the script sets the `set` stand-in's own arguments, and `declare` in a sourced file
declares a local of the `source` stand-in.
"""
from __future__ import annotations

import fcntl
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

SCRIPT_TIMEOUT_S = 10.0
_LAUNCH_MODULE = re.compile(r"^(verl\.trainer\.main_ppo|recipe(\.\w+)+\.main_\w+)$")
_LAUNCH_FILE = re.compile(r"(^|/)(verl/trainer/main_ppo|recipe(/\w+)+/main_\w+)\.py$")
_DOTTED_OVERRIDE = re.compile(r"^(\+\+|\+)?[A-Za-z_][\w\-]*(\.[\w\-]+)+=")


_PRELUDE = r"""
ulimit -f 65536
trap '' PIPE
command_not_found_handle() {
  builtin set +x
  local arg i=0 pid=$BASHPID
  for arg; do
    while ((${#arg} > 1000)); do printf 'a\0%s\0%s\0%s\0' "$pid" "$i" "${arg:0:1000}" >&__FD__; arg=${arg:1000}; done
    printf 'a\0%s\0%s\0%s\0' "$pid" "$i" "$arg" >&__FD__
    i=$((i + 1))
  done
  printf 'e\0%s\0%s\0' "$pid" "$#" >&__FD__
  return 0
}
basename() {
  local suffix= p
  if [[ ${1-} == -s ]]; then suffix=${2-}; shift 2; elif [[ ${1-} == -- ]]; then shift; fi
  p=${1-}; while [[ $p == */ && $p != / ]]; do p=${p%/}; done
  [[ $p == / ]] || p=${p##*/}
  suffix=${2-$suffix}; [[ -n $suffix && $p != "$suffix" ]] && p=${p%"$suffix"}
  printf '%s\n' "$p"
}
dirname() {
  local p=${1-}; while [[ $p == */ && $p != / ]]; do p=${p%/}; done
  if [[ $p != */* ]]; then p=.; else p=${p%/*}; while [[ $p == */ ]]; do p=${p%/}; done; p=${p:-/}; fi
  printf '%s\n' "$p"
}
date() { printf '%s\n' 20250101-000000; }
nproc() { printf '%s\n' 8; }
realpath() { (($#)) && printf '%s\n' "${@: -1}"; return 0; }
readlink() { (($#)) && printf '%s\n' "${@: -1}"; return 0; }
nvidia-smi() { return 0; }
cd() {
  local dir rest out= part
  case ${1-} in -L|-P|--) shift ;; esac
  dir=${1-$HOME}; [[ $dir == - ]] && dir=${OLDPWD:-$PWD}
  [[ $dir == /* ]] || dir=$PWD/$dir
  rest=$dir/
  while [[ -n $rest ]]; do
    part=${rest%%/*}; rest=${rest#*/}
    case $part in ''|.) ;; ..) out=${out%/*} ;; *) out=$out/$part ;; esac
  done
  OLDPWD=$PWD; PWD=${out:-/}; return 0
}
pwd() { printf '%s\n' "$PWD"; }
pushd() { cd "$@"; }
popd() { return 0; }
source() {
  local file=${1-}; [[ -z $file ]] && return 0
  [[ $file == /* ]] || file=$PWD/$file
  [[ -f $file && -r $file ]] || return 0
  eval "$(< "$file")"
}
.() { source "$@"; }
exec() { if (($#)); then "$@"; builtin exit "$?"; fi; return 0; }
set() {
  local a args=()
  while (($#)); do
    a=$1; shift
    case $a in
      -o|+o) if [[ ${1-} == errexit ]]; then shift; else args+=("$a"); (($#)) && { args+=("$1"); shift; }; fi ;;
      --|-) args+=("$a" "$@"); break ;;
      [-+]*) a=${a//e/}; ((${#a} > 1)) && args+=("$a") ;;
      *) args+=("$a" "$@"); break ;;
    esac
  done
  ((${#args[@]})) && builtin set "${args[@]}"
  return 0
}
PWD=__CWD__; OLDPWD=$PWD
builtin set -r
builtin source __NAME__
"""
_DROPPED_ENV = ("BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "CDPATH", "GLOBIGNORE", "BASH_XTRACEFD",
                "PROMPT_COMMAND", "PS4")


@dataclass
class ScriptRun:
    """The command lines a script tried to run, in order, and the end of what it printed on stderr."""

    commands: list[list[str]]
    stderr: str
    returncode: int


def run_script(path: str | Path, env: Mapping[str, str] | None = None, *,
               timeout: float = SCRIPT_TIMEOUT_S) -> ScriptRun:
    """Run the bash script at `path` in the sandbox the module docstring describes."""
    path = Path(path)
    bash = shutil.which("bash")
    if bash is None:
        raise ValueError(f"{path}: reading a run script needs bash, which is not on PATH")
    with tempfile.TemporaryDirectory(prefix="rlcorr-verl-") as tmp:
        root = Path(tmp)
        home, work, empty = root / "home", root / "work", root / "empty-path"
        for d in (home, work, empty):
            d.mkdir()
        name = re.sub(r"[^\w.\-]", "_", path.name) or "script.sh"
        shutil.copyfile(path, work / name)
        child_env = {k: v for k, v in (os.environ if env is None else env).items()
                     if k not in _DROPPED_ENV and not k.startswith("BASH_FUNC_")}
        child_env.update(PATH=str(empty), HOME=str(home))
        with open(root / "commands", "ab+") as record, open(root / "stderr", "wb+") as err:
            # A high descriptor, so that a script's own `3>&1` never redirects the record.
            fd = fcntl.fcntl(record.fileno(), fcntl.F_DUPFD, 100)
            try:
                prelude = (_PRELUDE.replace("__FD__", str(fd)).replace("__CWD__", shlex.quote(os.getcwd()))
                           .replace("__NAME__", shlex.quote(name)))
                returncode = _run_bash([bash, "--noprofile", "--norc", "-c", prelude, str(path)], cwd=work,
                                       env=child_env, stderr=err, fd=fd, timeout=timeout, path=path)
            finally:
                os.close(fd)
            record.seek(0)
            commands = _decode_commands(record.read())
            err.seek(max(0, err.seek(0, os.SEEK_END) - 65536))
            stderr = err.read().decode("utf-8", "replace")
    real_home = caller_home(env)

    def unsandbox(arg: str) -> str:
        return arg.replace(str(home), real_home).replace(str(work), os.getcwd())

    return ScriptRun([[unsandbox(a) for a in cmd] for cmd in commands], stderr, returncode)


def _run_bash(argv: list[str], *, cwd: Path, env: dict[str, str], stderr: Any, fd: int, timeout: float,
              path: Path) -> int:
    """Run bash in its own session (so a timeout kills everything it started); its exit status."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=stderr, pass_fds=(fd,), start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise ValueError(f"{path}: the script did not finish within {timeout:g} s in the sandbox (does it wait in "
                         "a loop for something, e.g. a Ray cluster?)") from None


def caller_home(env: Mapping[str, str] | None) -> str:
    """What $HOME means for the caller: env's HOME, else this process's."""
    return (env or {}).get("HOME") or os.environ.get("HOME") or str(Path.home())


def _decode_commands(data: bytes) -> list[list[str]]:
    """The handler's records, in the order each command started writing.

    Commands of one pipeline run at once, so the handler writes small pieces (one write each, to
    a file opened for appending), each tagged with its process id: `a pid index piece` (a piece of
    argument `index`) and `e pid argc` at the end. Pieces of a command the script garbled or that
    never finished are dropped.
    """
    fields = data.split(b"\0")
    args: dict[bytes, dict[int, bytes]] = {}
    done: dict[bytes, int] = {}
    i = 0
    try:
        while i < len(fields) - 1:
            if fields[i] == b"a":
                pid, index, piece = fields[i + 1], int(fields[i + 2]), fields[i + 3]
                parts = args.setdefault(pid, {})
                parts[index] = parts.get(index, b"") + piece
                i += 4
            elif fields[i] == b"e":
                done[fields[i + 1]] = int(fields[i + 2])
                i += 3
            else:
                break
    except (IndexError, ValueError):
        pass
    return [[parts[k].decode("utf-8", "replace") for k in range(done[pid])] for pid, parts in args.items()
            if done.get(pid) == len(parts) and sorted(parts) == list(range(len(parts)))]


def find_launches(commands: Sequence[Sequence[str]]) -> list[tuple[list[str], int]]:
    """The verl launches among recorded command lines: (command, index of its first verl argument).

    A known entry point (main_ppo, a recipe's main_*) anywhere wins; otherwise any `-m` module
    followed by at least three dotted key=value arguments.
    """
    known, other = [], []
    for cmd in commands:
        for i, arg in enumerate(cmd[:-1]):
            if arg in ("-m", "--module") and _LAUNCH_MODULE.match(cmd[i + 1]):
                known.append((list(cmd), i + 2))
                break
            if _LAUNCH_FILE.search(arg):
                known.append((list(cmd), i + 1))
                break
        else:
            for i, arg in enumerate(cmd[:-1]):
                if (arg in ("-m", "--module") and not cmd[i + 1].startswith("torch.distributed")
                        and sum(bool(_DOTTED_OVERRIDE.match(a)) for a in cmd[i + 2:]) >= 3):
                    other.append((list(cmd), i + 2))
                    break
    return known or other



"""Reading and writing the project's files safely: one atomic writer, one output-path check, one JSON reader.

Every file the project writes (heads, training state, teacher cache, profiles, traffic, cost caches, bench results)
goes through ``atomic_write``: the bytes go to a temporary file in the target's own folder, are flushed and fsynced,
and only then replace the target with ``os.replace``. A write that fails or is interrupted (an exception, Ctrl-C)
removes its temporary file and leaves the old target exactly as it was, so a good file is never replaced by a
truncated one. A target that exists and is not a regular file (a device such as ``/dev/full``, a directory, a
fifo, a socket) is refused: renaming over it would replace the node itself.

Commands call ``check_output_path`` when they parse their arguments, before any long work (loading a model,
generating, training), so a bad ``--out`` fails in a second, not after an hour.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator, Literal, overload

from sglang_spec.errors import SpecError

# JSON files we read are small (profiles, cost curves, JSONL lines): deeper nesting is corrupt or hostile input
_JSON_ERRORS = (ValueError, RecursionError, OverflowError)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISFIFO(mode):
        return "a fifo"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _refuse_non_regular(path: Path) -> None:
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return  # absent; check_output_path says what is wrong with its folder
    except OSError as error:
        raise SpecError(f"cannot check {path}: {error.strerror}") from None
    if not stat.S_ISREG(mode):
        raise SpecError(f"{path} is {_kind(mode)}, not a regular file; write to a file path instead")


def check_output_path(path: str | Path, force: bool = False, option: str = "--out") -> Path:
    """Validates a path a command will write, at argument time: the target is absent, or a regular file and
    ``force`` is set; its folder exists (or can be created: the nearest existing ancestor is a writable folder).
    Creates nothing. Returns the path."""
    path = Path(path)
    if str(path) == "" or path.name in ("", ".", ".."):
        raise SpecError(f"{option} {str(path)!r} names no file")
    _refuse_non_regular(path)
    if path.exists() and not force:
        raise SpecError(f"{path} exists; pass --force to overwrite it")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        if ancestor.is_symlink():
            raise SpecError(f"{option} {path}: {ancestor} is a broken link")
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise SpecError(f"{option} {path}: {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise SpecError(f"{option} {path}: the folder {ancestor} is not writable")
    return path


def _fsync_folder(folder: Path) -> None:
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # some file systems do not open folders; the rename is still atomic
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _mode_for(path: Path) -> int:
    """The replaced file's permissions, or what a plain ``open(path, "w")`` would give (0o666 minus the umask);
    ``mkstemp`` makes its file 0o600."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yields a temporary path in ``path``'s folder for a writer that needs a file name (safetensors, torch);
    on success the file is fsynced and renamed onto ``path``; on any failure it is removed and ``path`` is
    untouched. Creates missing parent folders."""
    path = Path(path)
    _refuse_non_regular(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as error:
        raise SpecError(f"cannot write {path}: {error.strerror}") from None
    os.close(descriptor)
    temporary = Path(name)
    try:
        os.chmod(temporary, _mode_for(path))
        yield temporary
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())
        _refuse_non_regular(path)  # it may have appeared while we wrote
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise SpecError(f"cannot write {path}: {error.strerror or error}") from None
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


@overload
def atomic_write(path: str | Path, mode: Literal["w"] = "w") -> contextlib.AbstractContextManager[IO[str]]: ...


@overload
def atomic_write(path: str | Path, mode: Literal["wb"]) -> contextlib.AbstractContextManager[IO[bytes]]: ...


def atomic_write(path: str | Path, mode: str = "w") -> contextlib.AbstractContextManager[IO[Any]]:
    """``with atomic_write(path) as handle: handle.write(...)``: text (UTF-8) or binary (``mode="wb"``), replacing
    ``path`` only when the block completes (see the module docstring)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    return _atomic_write(Path(path), mode)


@contextlib.contextmanager
def _atomic_write(path: Path, mode: str) -> Iterator[IO[Any]]:
    with atomic_path(path) as temporary:
        encoding = "utf-8" if mode == "w" else None
        with open(temporary, mode, encoding=encoding) as handle:
            yield handle
            handle.flush()


def replace_file(source: Path, target: Path) -> None:
    """Renames the finished file ``source`` (in ``target``'s folder) onto ``target``, fsynced first; a target
    that is not a regular file is refused."""
    _refuse_non_regular(target)
    try:
        with open(source, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(source, target)
    except OSError as error:
        raise SpecError(f"cannot write {target}: {error.strerror or error}") from None
    _fsync_folder(target.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_write(path) as handle:
        handle.write(text)


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=1) + "\n")


def check_input_file(path: str | Path, what: str = "file") -> Path:
    """``path`` is an existing regular file (reading a fifo would wait forever, a folder is no file)."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        raise SpecError(f"cannot read {what} {path}: {error.strerror or error}") from None
    if stat.S_ISDIR(mode):
        raise SpecError(f"{what} {path} is a folder, not a file")
    if not stat.S_ISREG(mode):
        raise SpecError(f"{what} {path} is {_kind(mode)}, not a regular file")
    return path


def read_text(path: str | Path, what: str = "file") -> str:
    """A UTF-8 text file, or one line saying why it cannot be read."""
    path = check_input_file(path, what)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise SpecError(f"cannot read {what} {path}: {error.strerror or error}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise SpecError(f"{what} {path} is not UTF-8 text (byte {error.start})") from None


def parse_json(text: str, line_numbers: bool = False) -> Any:
    """``json.loads`` whose every failure (syntax, nesting too deep, an integer too long) is a ``ValueError``
    with a one-line reason: ``not JSON (...)`` for a JSONL line, ``not valid JSON (... at line N)`` for a file
    (``line_numbers``)."""
    label = "not valid JSON" if line_numbers else "not JSON"
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        where = f" at line {error.lineno}" if line_numbers else ""
        raise ValueError(f"{label} ({error.msg}{where})") from None
    except RecursionError:
        raise ValueError(f"{label} (nested too deeply)") from None
    except _JSON_ERRORS as error:  # Python refuses integers of more than 4300 digits
        reason = "a number with too many digits" if "digits" in str(error) else str(error).splitlines()[0]
        raise ValueError(f"{label} ({reason})") from None


def read_json(path: str | Path, what: str = "file") -> Any:
    """A JSON file, or one line saying why it cannot be read or parsed."""
    text = read_text(path, what)
    try:
        return parse_json(text, line_numbers=True)
    except ValueError as error:
        raise SpecError(f"{path}: {error}") from None


def finite_number(value: Any) -> float | None:
    """``value`` as a finite float, or None when it is not a real number (bools, strings, NaN, infinities,
    integers too large for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if number == number and abs(number) != float("inf") else None

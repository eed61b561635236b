"""CURVE key files for ``tcp://`` connections, and ``python -m ringwire keygen``.

A TCP port is reachable by anyone on the network, so a ``tcp://`` listener given
``keys=`` speaks ZeroMQ's CURVE (CurveZMQ, built into libzmq): every message of every
socket of the connection -- the rendezvous and the connection's own socket -- is
encrypted, the client proves it holds a secret key whose public half the listener
lists, and the listener proves it holds the secret half of the server key the client
was given.  This module reads and checks the key files; :mod:`.curve` puts the keys on
the sockets and answers libzmq's questions about clients.

Key files are ZeroMQ certificates as :mod:`zmq.auth` writes them: ``NAME.key`` holds a
public key (hand it to peers), ``NAME.key_secret`` the public key and the secret key
(it stays on its host, mode 0600).  ``python -m ringwire keygen DIR --name NAME``
writes a pair (:func:`keygen`)::

    # the listener's host                     # each client's host
    python -m ringwire keygen keys --name server   python -m ringwire keygen keys --name worker1
    mkdir clients; cp worker1.key clients/    # (worker1.key copied from the client)

    listen("tcp://0.0.0.0:7000", keys=ringwire.ServerKeys(
        secret="keys/server.key_secret", clients="clients/"))
    connect("tcp://host:7000", keys=ringwire.ClientKeys(
        secret="keys/worker1.key_secret", server="keys/server.key"))

The files are read when the keys are made, so a wrong path or file fails at once,
naming it.  The listener's ``clients`` directory (every ``*.key`` in it, as
:mod:`zmq.auth` reads one) is read again whenever a file in it changes: add or remove
a client's ``.key`` and the next connection sees it (connections already open stay).

pyzmq is imported only when keys are made (``pip install 'ringwire[net]'``).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, TextIO

__all__ = ["ClientKeys", "ServerKeys", "add_command", "check_client", "check_server", "keygen"]

logger = logging.getLogger("ringwire")

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
_KEYGEN = "python -m ringwire keygen DIR --name NAME"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_MAX_FILE = 64 << 10  # a certificate is a few hundred bytes


def _zmq_auth() -> Any:
    try:
        import zmq.auth
    except ModuleNotFoundError as exc:
        if exc.name != "zmq":
            raise
        raise ModuleNotFoundError(
            "CURVE keys for tcp:// need pyzmq: pip install 'ringwire[net]'", name="zmq"
        ) from exc
    return zmq.auth


def _read(path: Path, role: str) -> tuple[bytes, bytes | None]:
    """``(public, secret or None)`` of the certificate at ``path`` (z85), checked."""
    auth = _zmq_auth()
    if not path.exists():
        raise FileNotFoundError(
            errno.ENOENT,
            f"{role} key file {path} does not exist (make a key pair with: {_KEYGEN})",
        )
    if path.is_dir():
        raise IsADirectoryError(
            errno.EISDIR, f"{role} key file {path} is a directory: give a file in it"
        )
    st = path.stat()
    if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_FILE:
        raise ValueError(
            f"{role} key file {path} is not a ZeroMQ CURVE certificate (not a regular file "
            f"of at most {_MAX_FILE} bytes); make one with: {_KEYGEN}"
        )
    try:
        public, secret = auth.load_certificate(path)
    except ValueError:
        raise ValueError(
            f"{role} key file {path} is not a ZeroMQ CURVE certificate (no public-key "
            f"line); make one with: {_KEYGEN}"
        ) from None
    except UnicodeDecodeError:  # pragma: no cover - load_certificate reads bytes
        raise ValueError(f"{role} key file {path} is not a ZeroMQ CURVE certificate") from None
    import zmq

    try:
        ok = len(zmq.utils.z85.decode(public)) == 32
        if secret is not None:
            ok = ok and zmq.curve_public(secret) == public
    except Exception:
        ok = False
    if not ok:
        raise ValueError(
            f"{role} key file {path} holds a malformed key (not 40 z85 characters, or a "
            f"secret key whose public half is not the file's); make a new pair with: {_KEYGEN}"
        )
    return public, secret


def _secret(path: Path, role: str) -> tuple[bytes, bytes]:
    public, secret = _read(path, role)
    if secret is None:
        raise ValueError(
            f"{role} key file {path} is a public certificate: this side needs its secret "
            f"one (NAME{SECRET_SUFFIX}, written beside NAME{PUBLIC_SUFFIX} by keygen)"
        )
    try:
        mode = path.stat().st_mode
    except OSError:  # pragma: no cover - it was just read
        mode = 0
    if mode & 0o077:
        logger.warning(
            "ringwire: the secret key file %s is readable by other users (mode %o): chmod 600 %s",
            path,
            stat.S_IMODE(mode),
            path,
        )
    return public, secret


def _public(path: Path, role: str) -> bytes:
    public, secret = _read(path, role)
    if secret is not None:
        raise ValueError(
            f"{role} key file {path} holds a secret key: give only the public certificate "
            f"(NAME{PUBLIC_SUFFIX}); a secret key must stay on its own host"
        )
    return public


def _path(value: Any, what: str) -> Path:
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{what} must be a path (str or os.PathLike), not {value!r}")
    return Path(os.fspath(value))


class ServerKeys:
    """A listener's CURVE keys: its own secret certificate and the clients it admits.

    ``secret`` is the listener's ``NAME.key_secret``; ``clients`` a directory of the
    admitted clients' public certificates (``*.key``, one per client; other files are
    ignored).  Pass it as ``listen("tcp://...", keys=...)``.  The files are checked
    now.  Raises ``FileNotFoundError`` / ``IsADirectoryError`` / ``NotADirectoryError``
    naming a path that is missing or of the wrong kind, ``ValueError`` for a file that
    is not a certificate, a public certificate where the secret one is needed (or a
    secret one in ``clients``), a directory with no client certificate,
    ``TypeError`` for a value that is not a path."""

    __slots__ = ("secret", "clients", "public_key", "_secret_key", "_lock", "_stamp", "_keys")

    def __init__(self, secret: str | os.PathLike[str], clients: str | os.PathLike[str]) -> None:
        self.secret = _path(secret, "ServerKeys(secret=)")
        self.clients = _path(clients, "ServerKeys(clients=)")
        self.public_key, self._secret_key = _secret(self.secret, "the listener's secret")
        self._lock = threading.Lock()
        self._stamp: Any = None
        self._keys: frozenset[bytes] = frozenset()
        self.admitted()

    def __repr__(self) -> str:
        return f"ServerKeys(secret={str(self.secret)!r}, clients={str(self.clients)!r})"

    @property
    def secret_key(self) -> bytes:
        """The listener's secret key (z85)."""
        return self._secret_key

    def admitted(self) -> frozenset[bytes]:
        """The admitted clients' public keys (z85), read again when a file in
        :attr:`clients` changed.  Raises as the constructor does (an emptied or removed
        directory admits nobody: the caller refuses every client)."""
        d = self.clients
        try:
            names = sorted(e.name for e in os.scandir(d) if e.name.endswith(PUBLIC_SUFFIX))
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT,
                f"the clients directory {d} does not exist (make it, and copy each "
                f"client's public NAME{PUBLIC_SUFFIX} into it)",
            ) from None
        except NotADirectoryError:
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"clients={d} is not a directory: give a directory of the clients' public "
                f"NAME{PUBLIC_SUFFIX} files",
            ) from None
        entries = []
        for name in names:
            try:
                st = os.stat(d / name)
            except OSError as exc:
                raise type(exc)(
                    exc.errno, f"the client key file {d / name} cannot be read: {exc.strerror}"
                ) from None
            entries.append((name, st.st_mtime_ns, st.st_size, st.st_ino))
        with self._lock:
            if entries == self._stamp:
                return self._keys
            if not entries:
                raise ValueError(
                    f"the clients directory {d} has no client certificate (*{PUBLIC_SUFFIX}): "
                    f"copy each client's public NAME{PUBLIC_SUFFIX} into it"
                )
            keys = frozenset(_public(d / name, "the client") for name, *_ in entries)
            self._stamp, self._keys = entries, keys
            return keys


class ClientKeys:
    """A client's CURVE keys: its own secret certificate and the listener's public one.

    ``secret`` is this client's ``NAME.key_secret`` (its ``NAME.key`` must be in the
    listener's clients directory); ``server`` the listener's public ``NAME.key``.  Pass
    it as ``connect("tcp://...", keys=...)`` (or ``connect_sync``).  The files are
    checked now; raises as :class:`ServerKeys` does."""

    __slots__ = ("secret", "server", "public_key", "secret_key", "server_key")

    def __init__(self, secret: str | os.PathLike[str], server: str | os.PathLike[str]) -> None:
        self.secret = _path(secret, "ClientKeys(secret=)")
        self.server = _path(server, "ClientKeys(server=)")
        self.public_key, self.secret_key = _secret(self.secret, "the client's secret")
        self.server_key = _public(self.server, "the listener's public")

    def __repr__(self) -> str:
        return f"ClientKeys(secret={str(self.secret)!r}, server={str(self.server)!r})"


def check_server(keys: Any) -> ServerKeys | None:
    """``keys`` if it is ``None`` or a :class:`ServerKeys`; ``TypeError`` otherwise."""
    if keys is None or isinstance(keys, ServerKeys):
        return keys
    raise TypeError(
        f"a listener's keys= must be ringwire.ServerKeys(secret=..., clients=...), not {keys!r}"
    )


def check_client(keys: Any) -> ClientKeys | None:
    """``keys`` if it is ``None`` or a :class:`ClientKeys`; ``TypeError`` otherwise."""
    if keys is None or isinstance(keys, ClientKeys):
        return keys
    raise TypeError(
        f"a client's keys= must be ringwire.ClientKeys(secret=..., server=...), not {keys!r}"
    )


# -- keygen --------------------------------------------------------------------------------


def default_name() -> str:
    """This host's name, as a file name stem (``ringwire`` when it has none)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).lstrip("._-")[:100]
    return name or "ringwire"


def keygen(
    directory: str | os.PathLike[str], name: str, *, force: bool = False
) -> tuple[Path, Path]:
    """Write a new key pair ``DIR/NAME.key`` (public, mode 0644) and
    ``DIR/NAME.key_secret`` (secret, mode 0600); return their paths.

    The secret file is never readable by others, not even for a moment: both are
    written by :func:`zmq.auth.create_certificates` in a fresh 0700 directory inside
    ``directory`` and moved into place (without ``force``, by ``link``, which never
    replaces a file).  ``directory`` is made (0700) if missing.  Raises
    ``FileExistsError`` naming a file that exists (without ``force``; nothing is
    written then), ``ValueError`` for a bad ``name``, ``NotADirectoryError`` /
    ``OSError`` naming the directory."""
    auth = _zmq_auth()
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"bad key name {name!r}: letters, digits, '.', '_' and '-' (at most 100, not "
            "starting with '.', '_' or '-')"
        )
    d = Path(os.fspath(directory))
    if d.exists() and not d.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{d} is not a directory")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = d / f"{name}{PUBLIC_SUFFIX}", d / f"{name}{SECRET_SUFFIX}"
    if not force:
        for p in (public, secret):
            if os.path.lexists(p):
                raise FileExistsError(
                    errno.EEXIST,
                    f"{p} exists: pass --force (force=True) to replace the key pair (peers "
                    "holding the old public key are refused from then on)",
                )
    tmp = Path(tempfile.mkdtemp(prefix=".keygen-", dir=d))  # mode 0700
    try:
        tmp_public, tmp_secret = (Path(p) for p in auth.create_certificates(tmp, name))
        os.chmod(tmp_secret, 0o600)
        os.chmod(tmp_public, 0o644)
        placed: list[Path] = []
        try:
            for src, dst in ((tmp_secret, secret), (tmp_public, public)):
                if force:
                    os.replace(src, dst)
                else:
                    os.link(src, dst)  # FileExistsError if one appeared meanwhile
                placed.append(dst)
        except BaseException:
            if not force:
                for p in placed:
                    p.unlink(missing_ok=True)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return public, secret


def add_command(sub: Any) -> None:
    """Register ``keygen`` with the ``python -m ringwire`` subcommands ``sub``."""
    k = sub.add_parser(
        "keygen",
        help="write a CURVE key pair for tcp:// listeners and clients",
        description=(
            f"Write DIR/NAME{PUBLIC_SUFFIX} (the public key: give it to peers; a listener "
            f"admits the clients whose {PUBLIC_SUFFIX} files are in its clients directory) "
            f"and DIR/NAME{SECRET_SUFFIX} (the secret key, mode 0600: it stays on this "
            "host).  Exit status 1: a file exists (without --force) or cannot be written."
        ),
    )
    k.add_argument("directory", metavar="DIR", help="where to write (made if missing)")
    k.add_argument("--name", help="file name stem (default: this host's name)")
    k.add_argument("--force", action="store_true", help="replace an existing key pair")
    k.set_defaults(func=_keygen_command)


def _keygen_command(args: Any, out: TextIO) -> int:
    name = args.name if args.name is not None else default_name()
    try:
        public, secret = keygen(args.directory, name, force=args.force)
        key = _read(public, "the new public")[0].decode()
    except (OSError, ValueError, ModuleNotFoundError) as exc:
        print(f"ringwire keygen: {exc}", file=sys.stderr)
        return 1
    out.write(
        f"public key  {public}   (give it to peers: a listener admits a client whose "
        f"{PUBLIC_SUFFIX} is in its clients directory)\n"
        f"secret key  {secret}   (mode 0600: keep it on this host)\n"
        f"z85 public  {key}\n"
    )
    return 0

"""The doctor's probes: what cannot be read without running something.

* :func:`memfd_support` creates (and closes) one sealed memory file in this process.
* :data:`TORCH_PROBE` and :data:`NIXL_PROBE` are small scripts run in *child*
  processes (:func:`start`, then :func:`collect` with a timeout): importing torch and
  asking ``torch.cuda`` initialises the CUDA driver, which a broken driver can hang,
  and NIXL loads UCX, which does not survive a fork.  A child is killed when its time
  is up, so the doctor never hangs and this process stays clean.  Each prints one JSON
  object on its last line; :mod:`ringwire._doctor` reads the keys it documents.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

__all__ = ["NIXL_PROBE", "TORCH_PROBE", "collect", "memfd_support", "start"]


def memfd_support() -> str | None:
    """``None`` when this kernel offers ``memfd_create`` with the seals ringwire puts on
    every memory file (:data:`ringwire._pool.segment.SEALS`: no shrinking, no growing,
    no more seals), else why not.  Creates and closes one empty memory file."""
    create = getattr(os, "memfd_create", None)
    if create is None:
        return f"os.memfd_create is not available ({sys.platform})"
    import fcntl

    from ._pool.segment import SEALS

    add_seals = getattr(fcntl, "F_ADD_SEALS", None)
    if add_seals is None:
        return "fcntl has no F_ADD_SEALS"
    try:
        fd = create("ringwire-doctor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        return f"memfd_create failed: {exc}"
    try:
        fcntl.fcntl(fd, add_seals, SEALS)
    except OSError as exc:
        return f"sealing a memory file failed: {exc}"
    finally:
        os.close(fd)
    return None


# -- child processes --------------------------------------------------------------------

TORCH_PROBE = """
import json, sys
out = {}
try:
    import torch
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"})); sys.exit(0)
out["version"] = str(torch.__version__)
out["cuda_build"] = torch.version.cuda
try:
    out["available"] = bool(torch.cuda.is_available())
    n = torch.cuda.device_count() if out["available"] else 0
    out["devices"] = [torch.cuda.get_device_name(i) for i in range(n)]
except Exception as exc:
    out["cuda_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""

# Creates the agent ringwire creates (ringwire._net.nixl.Agent), then asks UCX itself
# which transports and devices it reaches (ucp_context_print_info, through ctypes; the
# same libucp NIXL loaded, the same UCX_* environment).
NIXL_PROBE = r"""
import ctypes, glob, json, logging, os, sys
logging.getLogger("nixl").setLevel(logging.WARNING)
out = {}
try:
    import nixl_cu12
    from nixl_cu12._api import nixl_agent, nixl_agent_config
    agent = nixl_agent("ringwire-doctor", nixl_agent_config(enable_prog_thread=False,
                                                            backends=["UCX"]))
    out["ucx_backend"] = "UCX" in agent.backends
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"})); sys.exit(0)
try:
    libs = os.path.join(os.path.dirname(os.path.dirname(nixl_cu12.__file__)), "nixl_cu12.libs")
    found = glob.glob(os.path.join(libs, "libucp-*.so*")) + glob.glob(os.path.join(libs, "libucp.so*"))
    ucp = ctypes.CDLL(found[0] if found else "libucp.so.0")
    v = [ctypes.c_uint() for _ in range(3)]
    ucp.ucp_get_version(*map(ctypes.byref, v))
    out["ucx_version"] = ".".join(str(x.value) for x in v)
    config, ctx = ctypes.c_void_p(), ctypes.c_void_p()
    if ucp.ucp_config_read(None, None, ctypes.byref(config)) != 0:
        raise RuntimeError("ucp_config_read failed")
    params = (ctypes.c_uint64 * 64)()
    params[0], params[1] = 1, 2  # field_mask = FEATURES, features = RMA (NIXL reads)
    ucp.ucp_init_version.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p]
    if ucp.ucp_init_version(v[0].value, v[1].value, params, config, ctypes.byref(ctx)) != 0:
        raise RuntimeError("ucp_init failed")
    libc = ctypes.CDLL(None)
    libc.open_memstream.restype = ctypes.c_void_p
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    ucp.ucp_context_print_info.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    ucp.ucp_context_print_info(ctx, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    text = ctypes.string_at(buf, size.value).decode(errors="replace")
    out["transports"] = [line.split("--", 1)[1].strip() for line in text.splitlines()
                         if "resource" in line and "--" in line]
    ucp.ucp_cleanup(ctx)
    ucp.ucp_config_release(config)
except Exception as exc:
    out["ucx_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def start(code: str) -> subprocess.Popen[str]:
    """Run probe ``code`` (:data:`TORCH_PROBE`, :data:`NIXL_PROBE`) in a child process
    of this interpreter; :func:`collect` reads its answer."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", NIXL_LOG_LEVEL="WARN")
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip


def collect(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The probe's answer (the JSON object on its last line of output), or
    ``{"timeout": timeout}`` after killing a probe that took longer, or ``{"error"}``
    when it printed none.  Raises nothing."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"timeout": timeout}
    last = out.strip().splitlines()[-1:] if out else []
    try:
        result = json.loads(last[0]) if last else None
    except ValueError:
        result = None
    if not isinstance(result, dict):
        return {"error": f"the probe exited with status {proc.returncode} and no answer"}
    return result

"""A public URL for a local server: a Cloudflare quick tunnel through ``pycloudflared``.

A tunnel makes the server reachable from the internet, so it is refused without an API
key. Failures (no network, the cloudflared download blocked) raise ``TunnelError`` with a
one-line reason; the local server is not touched and keeps running.
"""
from __future__ import annotations

import secrets
import threading

TUNNEL_TIMEOUT_S = 60.0


class TunnelError(RuntimeError):
    """The tunnel could not be opened (the message is one line, fit to print)."""


def generate_api_key() -> str:
    """A fresh random key (what ``--api-key auto`` uses)."""
    return secrets.token_urlsafe(32)


def resolve_api_key(api_key: str | None) -> str | None:
    """``"auto"`` becomes a generated key; anything else is returned as given."""
    return generate_api_key() if api_key == "auto" else api_key


def open_tunnel(port: int, api_key: str | None, timeout_s: float = TUNNEL_TIMEOUT_S) -> str:
    """Open a quick tunnel to ``http://127.0.0.1:<port>`` and return its public URL."""
    if not api_key:
        raise TunnelError(
            "refusing to open a public tunnel without an API key: pass --api-key <key> or --api-key auto"
        )
    try:
        from pycloudflared import try_cloudflare
    except ImportError:
        raise TunnelError("the tunnel needs pycloudflared: pip install 'pageserve[server]'") from None

    result: dict = {}

    def run() -> None:
        try:
            result["urls"] = try_cloudflare(port=port, verbose=False)
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            result["error"] = e

    worker = threading.Thread(target=run, name="pageserve-tunnel", daemon=True)
    worker.start()
    worker.join(timeout_s)
    local = f"the server still runs locally on http://127.0.0.1:{port}"
    if worker.is_alive():
        raise TunnelError(f"the Cloudflare tunnel did not come up within {timeout_s:.0f} s; {local}")
    if "error" in result:
        e = result["error"]
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise TunnelError(f"could not open a Cloudflare quick tunnel ({type(e).__name__}: {reason}); {local}")
    return str(result["urls"].tunnel)


def close_tunnel(port: int) -> None:
    """Stop the tunnel to ``port`` if one is open."""
    try:
        from pycloudflared import try_cloudflare

        try_cloudflare.terminate(port)
    except Exception:  # noqa: BLE001 - nothing open, or already gone
        pass

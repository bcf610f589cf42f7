"""Prometheus web-config files (exporter-toolkit format): TLS files and basic-auth users.

    tls_server_config:
      cert_file: server.crt
      key_file: server.key
    basic_auth_users:
      prometheus: $2y$10$...     # bcrypt hash, e.g. `htpasswd -nBC 10 "" | tr -d ':\\n'`

The same file a node_exporter or Prometheus itself takes with `--web.config.file`.
"""
from __future__ import annotations

import base64
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .config import ConfigError, read_yaml

KEY = "monitor_config.prometheus.web_config_file"
WsgiApp = Callable[[dict, Callable], Iterable[bytes]]


@dataclass(frozen=True)
class WebConfig:
    cert_file: str | None = None
    key_file: str | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash


def load_web_config(path: str | Path) -> WebConfig:
    """Parse a web-config file; relative TLS paths are relative to the file (as Prometheus does)."""
    path = Path(path)
    data = read_yaml(path) or {}
    if not isinstance(data, Mapping):
        raise ConfigError(str(path), KEY, "not a YAML mapping",
                          "write tls_server_config and/or basic_auth_users keys")
    unknown = set(data) - {"tls_server_config", "basic_auth_users", "http_server_config"}
    if unknown:
        raise ConfigError(str(path), f"{KEY}: {sorted(unknown)[0]}", "unknown key",
                          "use tls_server_config and basic_auth_users")
    tls = data.get("tls_server_config") or {}
    cert, key = tls.get("cert_file"), tls.get("key_file")
    if bool(cert) != bool(key):
        raise ConfigError(str(path), f"{KEY}: tls_server_config", "cert_file and key_file go together",
                          "set both, or remove tls_server_config")
    resolve = (lambda p: str((path.parent / p).resolve())) if cert else (lambda p: None)
    users = {}
    for user, hashed in (data.get("basic_auth_users") or {}).items():
        if not isinstance(hashed, str) or not hashed.startswith("$2"):
            raise ConfigError(str(path), f"{KEY}: basic_auth_users.{user}", "not a bcrypt hash",
                              "store a bcrypt hash, e.g. from `htpasswd -nBC 10 \"\" | tr -d ':\\n'`")
        users[str(user)] = hashed.encode()
    if users:
        try:
            import bcrypt  # noqa: F401
        except ImportError:
            raise ConfigError(str(path), f"{KEY}: basic_auth_users", "bcrypt is not installed",
                              'pip install "mfotel[auth]"') from None
    return WebConfig(resolve(cert), resolve(key), users)


class BasicAuth:
    """WSGI middleware: HTTP basic auth against bcrypt hashes (verified pairs are cached)."""

    def __init__(self, app: WsgiApp, users: Mapping[str, bytes]) -> None:
        import bcrypt  # only needed when basic auth is configured
        self.app, self.users, self._bcrypt = app, users, bcrypt
        self._verified: set[tuple[str, bytes]] = set()
        self._lock = threading.Lock()

    def _allowed(self, header: str) -> bool:
        if not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return False
        hashed = self.users.get(user)
        if hashed is None:
            return False
        key = (user, password.encode())
        with self._lock:
            if key in self._verified:
                return True
        if self._bcrypt.checkpw(password.encode(), hashed):
            with self._lock:
                self._verified.add(key)
            return True
        return False

    def __call__(self, environ: dict, start_response: Callable) -> Any:
        if self._allowed(environ.get("HTTP_AUTHORIZATION", "")):
            return self.app(environ, start_response)
        start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="mfotel"'),
                                            ("Content-Type", "text/plain")])
        return [b"Unauthorized\n"]


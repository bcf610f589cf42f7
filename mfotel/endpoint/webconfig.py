"""Prometheus web-config files (exporter-toolkit format): TLS, mutual TLS, basic auth, headers.

    tls_server_config:
      cert_file: server.crt
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # mutual TLS
      client_ca_file: scrapers-ca.crt
      min_version: TLS12
    basic_auth_users:
      prometheus: $2y$10$...     # bcrypt hash, e.g. `htpasswd -nBC 10 "" | tr -d ':\\n'`
    http_server_config:
      headers: {X-Content-Type-Options: nosniff}
    rate_limit: {interval: 100ms, burst: 20}

The same file a node_exporter or Prometheus itself takes with `--web.config.file`. Every key is
honoured or refused with an error naming the file, the key and the fix: the endpoint is never
silently weaker than the file says. Relative paths are relative to the file, as in Prometheus.
This module parses and checks the file; mfotel.endpoint.serve applies it (auth, rate limit,
headers) and mfotel.endpoint.server serves it.
"""
from __future__ import annotations

import math
import re
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.errors import ConfigError, did_you_mean
from ..config.settings import PrometheusConfig
from ..config.source import read_yaml

KEY = "monitor_config.prometheus.web_config_file"

TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
#: Go's names (crypto/tls CipherSuites()) -> OpenSSL's; TLS 1.3 suites are always enabled, as in Go
CIPHER_SUITES = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_AES_128_GCM_SHA256": None, "TLS_AES_256_GCM_SHA384": None,
    "TLS_CHACHA20_POLY1305_SHA256": None,
}
CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1",
          "X25519": "X25519"}
CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
               "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
#: exporter-toolkit's settable response headers -> allowed values (empty: any)
HEADERS: dict[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (), "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"), "X-XSS-Protection": (),
    "Content-Security-Policy": ()}
_SECTIONS: dict[str, tuple[str, ...] | None] = {
    "tls_server_config": ("cert_file", "key_file", "client_auth_type", "client_ca_file",
                          "client_ca", "min_version", "max_version", "cipher_suites",
                          "curve_preferences", "prefer_server_cipher_suites",
                          "client_allowed_sans", "cert", "key"),
    "http_server_config": ("http2", "headers"),
    "basic_auth_users": None, "rate_limit": ("interval", "burst")}
_BCRYPT = re.compile(r"^\$2[abxy]?\$(\d\d)\$[./A-Za-z0-9]{53}$")
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class TlsConfig:
    """`tls_server_config`: the server's certificate and whom it accepts."""
    cert_file: str
    key_file: str
    client_auth_type: str = "NoClientCert"
    client_ca_file: str | None = None
    client_ca: str | None = None            # the same, as inline PEM
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()     # Go's names; empty: OpenSSL's defaults
    curve: str | None = None                # the one curve of curve_preferences
    prefer_server_cipher_suites: bool = True
    client_allowed_sans: tuple[str, ...] = ()

    def context(self) -> ssl.SSLContext:
        """The server's SSLContext; raises OSError / ssl.SSLError on unreadable files."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = TLS_VERSIONS[self.min_version]
        context.maximum_version = TLS_VERSIONS[self.max_version]
        context.load_cert_chain(self.cert_file, self.key_file)
        context.verify_mode = CLIENT_AUTH[self.client_auth_type]
        if self.client_ca_file:
            context.load_verify_locations(cafile=self.client_ca_file)
        if self.client_ca:
            context.load_verify_locations(cadata=self.client_ca)
        suites = [name for s in self.cipher_suites if (name := CIPHER_SUITES[s])]
        if suites:
            context.set_ciphers(":".join(suites))
        if self.curve:
            context.set_ecdh_curve(CURVES[self.curve])
        if self.prefer_server_cipher_suites:
            context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
        else:
            context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
        return context


@dataclass(frozen=True)
class WebConfig:
    tls: TlsConfig | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: Mapping[str, str] = field(default_factory=dict)  # added to every response
    rate_limit: tuple[float, int] | None = None  # (seconds between requests, burst)


# ---------------------------------------------------------------- loading
def load_web_config(path: str | Path) -> WebConfig:
    """Parse and check a web-config file (certificates are loaded once to find errors early)."""
    path = Path(path)
    data = read_yaml(path) or {}
    fail = _Fail(str(path))
    if not isinstance(data, Mapping):
        raise fail("", "not a YAML mapping", "write tls_server_config and/or basic_auth_users keys")
    for name, value in data.items():
        if name not in _SECTIONS:
            raise fail(str(name), "unknown key", f"use one of {', '.join(_SECTIONS)}"
                       f"{did_you_mean(name, _SECTIONS)}")
        keys = _SECTIONS[name]
        if value is not None and not isinstance(value, Mapping):
            raise fail(name, f"{value!r} is not a mapping", "write it as key: value pairs")
        if keys is None:  # basic_auth_users: any user name
            continue
        for key in value or {}:
            if key not in keys:
                raise fail(f"{name}.{key}", "unknown key",
                           f"use one of {', '.join(keys)}{did_you_mean(key, keys)}")
    tls = _tls(data.get("tls_server_config") or {}, path.parent, fail)
    if tls is not None:
        _check_context(tls, fail)
    users = _users(data.get("basic_auth_users") or {}, fail)
    http = data.get("http_server_config") or {}
    if not isinstance(http.get("http2", True), bool):
        raise fail("http_server_config.http2", f"{http['http2']!r} is not a boolean",
                   "write http2: true or false (the endpoint speaks HTTP/1.1 either way)")
    return WebConfig(tls, users, _headers(http.get("headers") or {}, fail),
                     _rate_limit(data.get("rate_limit") or {}, fail))


def certificate_files(cert_file: str, key_file: str, source: str) -> WebConfig:
    """TLS from `monitor_config.prometheus.certfile` / `keyfile` (no web-config file)."""
    tls = TlsConfig(cert_file=cert_file, key_file=key_file)
    try:
        tls.context()
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc
        raise ConfigError(source, "monitor_config.prometheus.certfile",
                          f"cannot load {cert_file} with {key_file} ({reason})",
                          "point certfile and keyfile at readable PEM files; the key must match "
                          "the certificate") from None
    return WebConfig(tls)


def endpoint_web_config(prom: PrometheusConfig, source: str) -> WebConfig | None:
    """The TLS / auth `monitor_config.prometheus` gives a rank's endpoint (and the node
    endpoint beside it): the web-config file, or certfile + keyfile, or None; ConfigError when
    a file is bad (`source` names the training YAML)."""
    if prom.web_config_file:
        return load_web_config(prom.web_config_file)
    if prom.certfile:
        return certificate_files(prom.certfile, prom.keyfile or "", source)
    return None


class _Fail:
    """Builds the ConfigError of one web-config file."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __call__(self, key: str, problem: str, fix: str) -> ConfigError:
        return ConfigError(self.source, f"{KEY}: {key}" if key else KEY, problem, fix)


def _names(value: Any, key: str, table: Mapping[str, Any], fail: _Fail) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise fail(key, f"{value!r} is not a list of names",
                   f"write a list, e.g. [{next(iter(table))}]")
    for name in value:
        if name not in table:
            raise fail(key, f"unknown name {name!r}",
                       f"use names from: {', '.join(table)}{did_you_mean(name, table)}")
    return tuple(value)


def _tls(section: Mapping[str, Any], folder: Path, fail: _Fail) -> TlsConfig | None:
    if not section:
        return None
    for name, value in section.items():
        if name not in ("cipher_suites", "curve_preferences", "client_allowed_sans",
                        "prefer_server_cipher_suites") and not isinstance(value, (str, type(None))):
            raise fail(f"tls_server_config.{name}", f"{value!r} is not a string",
                       "write a file name or a name, e.g. min_version: TLS12")
    for inline, use in (("cert", "cert_file"), ("key", "key_file")):
        if section.get(inline):
            raise fail(f"tls_server_config.{inline}", "inline certificates and keys are not "
                       "supported", "write the PEM to a file only the training user reads and "
                       f"set {use}")
    cert, private = section.get("cert_file"), section.get("key_file")
    if not cert or not private:
        others = sorted(k for k in section if k not in ("cert_file", "key_file"))
        what = (f"{', '.join(others)} given but TLS is off" if others
                else "cert_file and key_file go together")
        raise fail(f"tls_server_config.{'key_file' if cert else 'cert_file'}", what,
                   "set both cert_file and key_file (the server's certificate), or remove "
                   "tls_server_config")
    return TlsConfig(cert_file=_file(folder, cert), key_file=_file(folder, private),
                     **_client_auth(section, folder, fail), **_versions(section, fail),
                     **_suites(section, fail))


def _client_auth(section: Mapping[str, Any], folder: Path, fail: _Fail) -> dict[str, Any]:
    key = "tls_server_config"
    auth = section.get("client_auth_type") or "NoClientCert"
    if auth in ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert"):
        raise fail(f"{key}.client_auth_type", f"{auth} accepts certificates nobody verified "
                   "(any self-signed one), which authenticates no one, and is not supported",
                   "use RequireAndVerifyClientCert with client_ca_file (mutual TLS), "
                   "VerifyClientCertIfGiven, or NoClientCert")
    if auth not in CLIENT_AUTH:
        raise fail(f"{key}.client_auth_type", f"unknown value {auth!r}",
                   f"use one of {', '.join(CLIENT_AUTH)}{did_you_mean(auth, CLIENT_AUTH)}")
    values: dict[str, Any] = {"client_auth_type": auth}
    if section.get("client_ca_file"):
        values["client_ca_file"] = _file(folder, section["client_ca_file"])
    if section.get("client_ca"):
        values["client_ca"] = section["client_ca"]
    has_ca = "client_ca_file" in values or "client_ca" in values
    if has_ca and auth == "NoClientCert":
        raise fail(f"{key}.client_auth_type", "client_ca_file is set but client certificates are "
                   "not asked for", "set client_auth_type: RequireAndVerifyClientCert")
    if auth != "NoClientCert" and not has_ca:
        raise fail(f"{key}.client_ca_file", f"client_auth_type {auth} needs the CA that signs the "
                   "scrapers' certificates", "set client_ca_file (a PEM file of that CA)")
    sans = section.get("client_allowed_sans")
    if sans is not None:
        if not isinstance(sans, list) or not sans or not all(isinstance(s, str) for s in sans):
            raise fail(f"{key}.client_allowed_sans", f"{sans!r} is not a list of names",
                       "list the DNS names, IPs, e-mails or URIs of the allowed client "
                       "certificates")
        if auth != "RequireAndVerifyClientCert":
            raise fail(f"{key}.client_allowed_sans", f"needs client certificates, but "
                       f"client_auth_type is {auth}",
                       "set client_auth_type: RequireAndVerifyClientCert")
        values["client_allowed_sans"] = tuple(sans)
    return values


def _versions(section: Mapping[str, Any], fail: _Fail) -> dict[str, Any]:
    key = "tls_server_config"
    values: dict[str, Any] = {"min_version": "TLS12", "max_version": "TLS13"}
    for bound in values:
        version = section.get(bound)
        if version is not None:
            if version not in TLS_VERSIONS:
                raise fail(f"{key}.{bound}", f"unknown TLS version {version!r}",
                           f"use one of {', '.join(TLS_VERSIONS)}")
            values[bound] = version
    if TLS_VERSIONS[values["min_version"]] > TLS_VERSIONS[values["max_version"]]:
        raise fail(f"{key}.min_version", f"{values['min_version']} is above max_version "
                   f"{values['max_version']}", "lower min_version or raise max_version")
    return values


def _suites(section: Mapping[str, Any], fail: _Fail) -> dict[str, Any]:
    key = "tls_server_config"
    values: dict[str, Any] = {}
    if section.get("cipher_suites") is not None:
        values["cipher_suites"] = _names(section["cipher_suites"], f"{key}.cipher_suites",
                                         CIPHER_SUITES, fail)
    if section.get("curve_preferences") is not None:
        curves = _names(section["curve_preferences"], f"{key}.curve_preferences", CURVES, fail)
        if len(curves) > 1:
            raise fail(f"{key}.curve_preferences", f"{len(curves)} curves listed; Python's ssl "
                       "module can restrict the key exchange to one curve only",
                       f"list one curve (e.g. [{curves[0]}]) or remove curve_preferences")
        values["curve"] = curves[0] if curves else None
    prefer = section.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise fail(f"{key}.prefer_server_cipher_suites", f"{prefer!r} is not a boolean",
                   "write true or false")
    values["prefer_server_cipher_suites"] = prefer
    return values


def _file(folder: Path, name: Any) -> str:
    return str((folder / str(name)).resolve())


def _check_context(tls: TlsConfig, fail: _Fail) -> None:
    """Load the certificates once, so a bad file is an error before training."""
    key = "tls_server_config"
    steps: list[tuple[str, Callable[[ssl.SSLContext], Any]]] = [
        ("cert_file", lambda c: c.load_cert_chain(tls.cert_file, tls.key_file))]
    if tls.client_ca_file:
        steps.append(("client_ca_file",
                      lambda c: c.load_verify_locations(cafile=tls.client_ca_file)))
    if tls.client_ca:
        steps.append(("client_ca", lambda c: c.load_verify_locations(cadata=tls.client_ca)))
    for name, load in steps:
        try:
            load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            reason = getattr(exc, "strerror", None) or getattr(exc, "reason", None) or exc
            raise fail(f"{key}.{name}", f"cannot load it ({reason})",
                       "point it at a readable PEM file" + (
                           " whose key_file matches the certificate" if name == "cert_file" else "")
                       ) from None
    try:
        tls.context()
    except (OSError, ValueError) as exc:
        raise fail(key, f"the TLS settings are refused by OpenSSL ({exc})",
                   "check cipher_suites and curve_preferences against the TLS versions "
                   "allowed") from None


def _users(section: Mapping[str, Any], fail: _Fail) -> dict[str, bytes]:
    users = {}
    for user, hashed in section.items():
        if not isinstance(hashed, str) or not _BCRYPT.match(hashed):
            raise fail(f"basic_auth_users.{user}", "not a bcrypt hash",
                       "store a bcrypt hash, e.g. from `htpasswd -nBC 10 \"\" | tr -d ':\\n'`")
        users[str(user)] = hashed.encode()
    if users:
        try:
            import bcrypt  # noqa: F401
        except ImportError:
            raise fail("basic_auth_users", "bcrypt is not installed",
                       'pip install "mfotel[auth]"') from None
    return users


def _headers(section: Any, fail: _Fail) -> dict[str, str]:
    if not isinstance(section, Mapping):
        raise fail("http_server_config.headers", f"{section!r} is not a mapping",
                   "write header: value pairs")
    for name, value in section.items():
        if name not in HEADERS:
            raise fail(f"http_server_config.headers.{name}", "this header cannot be configured",
                       f"use one of {', '.join(HEADERS)}{did_you_mean(name, HEADERS)}")
        if not isinstance(value, str) or (HEADERS[name] and value not in HEADERS[name]):
            allowed = f"one of {', '.join(HEADERS[name])}" if HEADERS[name] else "a string"
            raise fail(f"http_server_config.headers.{name}", f"{value!r} is not allowed",
                       f"use {allowed}")
    return {str(k): v for k, v in section.items() if v}


def parse_duration(text: Any) -> float | None:
    """Seconds of a Go duration ("100ms", "1m30s"), or None if it is not one."""
    if text == 0:
        return 0.0
    if not isinstance(text, str) or not text or _DURATION.sub("", text):
        return None
    return sum(float(n) * _UNITS[u] for n, u in _DURATION.findall(text))


def _rate_limit(section: Mapping[str, Any], fail: _Fail) -> tuple[float, int] | None:
    if not section:
        return None
    interval = parse_duration(section.get("interval", 0))
    if interval is None or not math.isfinite(interval):
        raise fail("rate_limit.interval", f"{section.get('interval')!r} is not a duration",
                   "write a Go duration such as 100ms or 1s (0 turns the limit off)")
    burst = section.get("burst", 0)
    if interval == 0:
        return None
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
        raise fail("rate_limit.burst", f"{burst!r} is not a whole number >= 1",
                   "set burst: the requests allowed at once (e.g. 10)")
    return interval, burst

"""The alerts receiver's credentials: from files and the environment, as Alertmanager's webhook
`http_config` sends them, and the matching `http_config`.

    receiver option (secret: a file, or the environment)     Alertmanager http_config
    --bearer-token-file FILE ($MFOTEL_RECEIVER_BEARER_TOKEN)    authorization.credentials_file
    --basic-auth-username U                                     basic_auth.username
    --basic-auth-password-file FILE                             basic_auth.password_file
        ($MFOTEL_RECEIVER_BASIC_AUTH_PASSWORD)

Secrets never come from the command line (`ps` shows it) and are never printed. Files are read
as Alertmanager reads them (surrounding whitespace trimmed). Requests are checked by
mfotel.endpoint.auth (`Credentials`, `RequireCredentials`: constant-time comparisons).
"""
from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..endpoint.auth import Credentials
from ..regular_file import read_regular_file

TOKEN_ENV = "MFOTEL_RECEIVER_BEARER_TOKEN"
PASSWORD_ENV = "MFOTEL_RECEIVER_BASIC_AUTH_PASSWORD"
MAX_SECRET_BYTES = 64 * 1024


class AuthSetupError(ValueError):
    """The receiver's credentials are misconfigured; the message names the option and the fix."""


def read_secret(path: str | Path, option: str) -> bytes:
    """A secret file's content, trimmed as Alertmanager trims it; AuthSetupError if unusable."""
    try:
        data = read_regular_file(os.fspath(path), MAX_SECRET_BYTES)
    except FileNotFoundError:
        raise AuthSetupError(f"{option} {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise AuthSetupError(f"{option} {path}: {getattr(exc, 'strerror', None) or exc}") from None
    secret = data.strip()
    if not secret:
        raise AuthSetupError(f"{option} {path}: the file is empty; write the secret into it")
    return secret


def _from_env(environ: Mapping[str, str], name: str) -> bytes | None:
    value = environ.get(name, "").strip()
    return value.encode() if value else None


def load_auth(bearer_token_file: str | None = None, basic_auth_username: str | None = None,
              basic_auth_password_file: str | None = None,
              environ: Mapping[str, str] = os.environ) -> Credentials | None:
    """Credentials from files and the environment; None if none are given.

        auth = load_auth(bearer_token_file="/etc/mfotel/receiver-token")
    """
    token = _from_env(environ, TOKEN_ENV)
    if bearer_token_file:
        if token is not None:
            raise AuthSetupError(f"both --bearer-token-file and ${TOKEN_ENV} are set: keep one")
        token = read_secret(bearer_token_file, "--bearer-token-file")
    password = _from_env(environ, PASSWORD_ENV)
    if basic_auth_password_file:
        if password is not None:
            raise AuthSetupError(f"both --basic-auth-password-file and ${PASSWORD_ENV} are "
                                 f"set: keep one")
        password = read_secret(basic_auth_password_file, "--basic-auth-password-file")
    if (basic_auth_username is None) != (password is None):
        raise AuthSetupError("basic auth needs --basic-auth-username and a password "
                             f"(--basic-auth-password-file or ${PASSWORD_ENV})")
    if token is None and password is None:
        return None
    return Credentials(token, basic_auth_username, password)


def auth_from_args(args: argparse.Namespace,
                   environ: Mapping[str, str] = os.environ) -> Credentials | None:
    """Credentials from the `add_auth_arguments` options (see load_auth)."""
    return load_auth(args.bearer_token_file, args.basic_auth_username,
                     args.basic_auth_password_file, environ)


def world_readable(path: str | Path | None) -> bool:
    """Whether other users may read the secret file (worth a warning, like ssh gives)."""
    try:
        return path is not None and bool(os.stat(path).st_mode & stat.S_IROTH)
    except OSError:
        return False


def alertmanager_http_config(credentials_file: str | None = None, username: str | None = None,
                             password_file: str | None = None,
                             ca_file: str | None = None) -> dict[str, Any]:
    """The `http_config` of an Alertmanager webhook that authenticates to this receiver."""
    config: dict[str, Any] = {}
    if credentials_file:
        config["authorization"] = {"type": "Bearer", "credentials_file": credentials_file}
    if username:
        config["basic_auth"] = {"username": username, "password_file": password_file}
    if ca_file:
        config["tls_config"] = {"ca_file": ca_file}
    return config


def add_auth_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "authentication (required with --control-dir; secrets from files or the environment, "
        "never the command line)")
    group.add_argument("--bearer-token-file", metavar="FILE",
                       help="accept `Authorization: Bearer <token>` with the token in FILE "
                            f"(or ${TOKEN_ENV}); Alertmanager: http_config.authorization."
                            "credentials_file")
    group.add_argument("--basic-auth-username", metavar="NAME",
                       help="accept HTTP basic auth as NAME; Alertmanager: http_config."
                            "basic_auth.username")
    group.add_argument("--basic-auth-password-file", metavar="FILE",
                       help=f"the basic-auth password (or ${PASSWORD_ENV}); Alertmanager: "
                            "http_config.basic_auth.password_file")
    group.add_argument("--insecure-no-auth", action="store_true",
                       help="let --control-dir act on webhooks from anyone who can reach the "
                            "port (only on a network you fully trust)")

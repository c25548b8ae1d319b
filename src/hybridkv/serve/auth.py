"""Who may do what on ``hybridkv serve`` and ``hybridkv router``: API keys, an admin key, and
tenants bound to keys.

A client sends its key as ``Authorization: Bearer KEY`` (what the ``openai`` client sends). Routes
fall in three groups (:func:`serve_route_kind`, :func:`router_route_kind`):

* **open**: ``/health``, readable without a key (as vLLM's ``--api-key``, which guards the ``/v1``
  routes only, and SGLang's, which leaves ``/health`` and ``/metrics`` open);
* **metrics**: ``/metrics``: open while the API is (no API key), else the admin key or an API key
  bound to no tenant; a key bound to a tenant is refused (403), as the figures are every tenant's
  counts and timings;
* **api**: ``/v1/*`` (completions, chat, models) and SGLang's metadata and load routes: an API key
  or the admin key;
* **admin**: ``/admin/*``, ``/flush_cache`` and ``/v1/cache/*`` (the event feed holds every
  tenant's entry keys), and the router's ``/router/stats`` and ``/flush_cache``: the admin key
  only; except ``POST /admin/cache/invalidate`` (**scoped**, on a worker and on the router), which
  a key bound to a tenant may also use for its own tenant's entries (the route refuses any other
  scope with a 403).

A :class:`KeyRing` with no API key leaves the api routes open; with no admin key, the admin
routes are open only when there is no API key either (a server given API keys but no admin key
refuses its admin routes). An API key may be bound to a tenant: its requests are that tenant's,
and a request naming another tenant (``X-Tenant`` header or ``tenant`` field) is refused with a
403 before anything is looked up, so it learns nothing of the other tenant's cache. A key bound to
no tenant, and the admin key, may name any tenant (a trusted gateway, e.g. ``hybridkv router``).

Keys are kept as SHA-256 digests and compared with :func:`hmac.compare_digest` against every
key, without stopping at a match (constant time in the key's content and in which key matched).
Keys are never logged, echoed in an error, or shown by ``repr``; only counts are.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path

from hybridkv.serve.protocol import MAX_ID_LEN, APIError, check_tenant, tenant_header

OPEN, API, ADMIN, SCOPED, METRICS = "open", "api", "admin", "scoped", "metrics"
"""Route groups (see the module docstring); ``SCOPED``: an admin route that a key bound to a tenant
may also use, confined to its own tenant (``POST /admin/cache/invalidate``); ``METRICS``: ``GET
/metrics``, open while the API is, else for the admin key and keys bound to no tenant."""

_SCOPED_PATHS = frozenset({"/admin/cache/invalidate"})

API_KEY_ENV, ADMIN_KEY_ENV, WORKER_KEY_ENV = "HYBRIDKV_API_KEY", "HYBRIDKV_ADMIN_KEY", "HYBRIDKV_WORKER_KEY"
"""Environment variables read when the matching option is not given (a key on a command line is
visible to every user of the machine in its process list)."""

_SERVE_API_PATHS = frozenset({"/server_info", "/get_server_info", "/model_info", "/get_model_info", "/get_load"})


def serve_route_kind(path: str) -> str | None:
    """The group of a ``hybridkv serve`` route ``path`` (``None``: no route of this server)."""
    if path == "/health":
        return OPEN
    if path == "/metrics":
        return METRICS
    if path in _SCOPED_PATHS:
        return SCOPED
    if path.startswith(("/admin/", "/v1/cache/")) or path == "/flush_cache":
        return ADMIN
    if path.startswith("/v1/") or path in _SERVE_API_PATHS:
        return API
    return None


def router_route_kind(path: str) -> str | None:
    """The group of a ``hybridkv router`` route ``path`` (``None``: no route of the router):
    ``POST /admin/cache/invalidate`` is scoped as on a worker, ``/flush_cache`` and
    ``/router/stats`` are admin routes."""
    if path in ("/health", "/metrics"):
        return OPEN
    if path in _SCOPED_PATHS:
        return SCOPED
    if path in ("/router/stats", "/flush_cache"):
        return ADMIN
    if path.startswith("/v1/"):
        return API
    return None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who sent a request that passed :meth:`KeyRing.check`.

    Attributes:
        admin: the admin key was given.
        tenant: the tenant the key is bound to; ``None``: the request may name any tenant (a key
            bound to none, the admin key, or an open server).
    """

    admin: bool = False
    tenant: str | None = None


OPEN_PRINCIPAL = Principal()


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def check_key(key: object, where: str) -> str:
    """``key`` if it is usable as a Bearer key: a non-empty string of printable ASCII without
    spaces (what an ``Authorization`` header carries).

    Raises:
        ValueError: naming ``where`` (the option or file entry), never the key itself.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"{where}: a key must be a non-empty string")
    if not all(33 <= ord(ch) <= 126 for ch in key):
        raise ValueError(f"{where}: a key must be printable ASCII without spaces ({len(key)} characters given; "
                         "the key is not shown)")
    return key


class KeyRing:
    """The keys a server or router accepts.

    Args:
        api_keys: API key -> the tenant it is bound to (``None``: bound to none).
        admin_keys: admin keys.

    Raises:
        ValueError: a key that is not printable ASCII without spaces, a tenant that is not a string
            of 1 to 256 characters, or a key given both as an API key and as an admin key (the
            messages never show a key).
    """

    def __init__(self, api_keys: dict[str, str | None] | None = None, admin_keys: tuple[str, ...] = ()) -> None:
        api_keys = dict(api_keys or {})
        for i, (key, tenant) in enumerate(api_keys.items()):
            check_key(key, f"API key {i + 1}")
            if tenant == "":
                raise ValueError(f"API key {i + 1}: its tenant is empty (''); give a tenant of 1 to {MAX_ID_LEN} "
                                 "characters, or None for a key bound to no tenant")
            if tenant is not None and (not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_ID_LEN):
                raise ValueError(f"API key {i + 1}: its tenant must be a string of 1 to {MAX_ID_LEN} characters")
        for i, key in enumerate(admin_keys):
            check_key(key, f"admin key {i + 1}")
            if key in api_keys:
                raise ValueError(f"admin key {i + 1} is also given as an API key; give the admin key only once")
        self._api = [(_digest(k), t) for k, t in api_keys.items()]
        self._admin = [_digest(k) for k in admin_keys]

    @property
    def api_open(self) -> bool:
        """No API key: the api routes take requests without one."""
        return not self._api

    @property
    def admin_open(self) -> bool:
        """No key at all: the admin routes take requests without one."""
        return not self._api and not self._admin

    @property
    def bound(self) -> int:
        """API keys bound to a tenant."""
        return sum(t is not None for _, t in self._api)

    def __repr__(self) -> str:
        return f"KeyRing({len(self._api)} API keys, {self.bound} bound to a tenant, {len(self._admin)} admin keys)"

    def describe(self, admin_does: str = "purge or flush the cache", open_routes: str | None = None) -> str:
        """One line for the start-up log: what is open and how many keys guard the rest (counts
        only, never a key); ``admin_does`` says what an open admin route lets anyone do,
        ``open_routes`` which routes never need a key (default: a server's: ``/health``, and
        ``/metrics`` while the API is open; the router has no ``/metrics``)."""
        if open_routes is None:
            open_routes = "/health and /metrics are" if self.api_open else \
                "/metrics takes the admin key or a key bound to no tenant; /health is"
        if self.api_open:
            api = "the API is OPEN: no --api-key, so any client may use it and name any tenant"
        else:
            api = f"the API takes {len(self._api)} API key(s), {self.bound} bound to a tenant"
        if self.admin_open:
            admin = f"the admin routes are OPEN: no --admin-key, so any client may {admin_does}"
        elif self._admin:
            admin = "the admin routes take the admin key"
        else:
            admin = "the admin routes are refused: no --admin-key was given" + (
                " (a key bound to a tenant may still invalidate that tenant's entries)" if self.bound else "")
        return f"{api}; {admin}; {open_routes} open"

    def _match(self, key: str) -> tuple[bool, bool, str | None]:
        """``(api match, admin match, bound tenant)``, every stored key compared."""
        d = _digest(key)
        api, tenant, admin = False, None, False
        for stored, bound in self._api:
            if hmac.compare_digest(stored, d):       # no early exit: every key is compared
                api, tenant = True, bound
        for stored in self._admin:
            if hmac.compare_digest(stored, d):
                admin = True
        return api, admin, tenant

    def check(self, headers, kind: str | None) -> Principal:
        """The :class:`Principal` of a request to a route of group ``kind`` with ``headers`` (a
        Starlette ``Headers``).

        Raises:
            APIError: 401 (``invalid_api_key``) for a missing or wrong key; 403
                (``admin_key_required``) for an API key on an admin route, or any key when the
                server has no admin key but has API keys; on a ``SCOPED`` route, for a key bound to
                no tenant only (a bound key passes, with its tenant).
        """
        if kind is None or kind == OPEN:
            return OPEN_PRINCIPAL
        if kind == METRICS and self.api_open:
            return OPEN_PRINCIPAL
        if kind == API and self.api_open:
            return OPEN_PRINCIPAL
        if kind in (ADMIN, SCOPED) and self.admin_open:
            return OPEN_PRINCIPAL
        values = headers.getlist("authorization")
        scheme, _, key = values[0].partition(" ") if len(values) == 1 else ("", "", "")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "no API key was provided: send it in an Authorization header using Bearer auth "
                                "(Authorization: Bearer YOUR_KEY)", None, "invalid_api_key")
        api, admin, tenant = self._match(key)
        if not api and not admin:
            raise APIError(401, "the API key provided is not valid", None, "invalid_api_key")
        if admin:
            return Principal(admin=True)
        if kind == METRICS and tenant is not None:
            raise APIError(403, "a key bound to a tenant may not read /metrics (every tenant's counts and timings); "
                                "use the admin key or a key bound to no tenant", None, "tenant_scope",
                           "permission_error")
        if kind == METRICS:
            return Principal()
        if kind == SCOPED and tenant is not None:
            return Principal(tenant=tenant)            # its own tenant's scope only (the route confines it)
        if kind == SCOPED:
            why = "this route needs the admin key" if self._admin else \
                "this server has no admin key (start it with --admin-key to use this route)"
            raise APIError(403, f"{why}, or a key bound to a tenant (for that tenant's entries); a key bound to no "
                                "tenant may not administer the cache", None, "admin_key_required", "permission_error")
        if kind == ADMIN:
            why = "this route needs the admin key" if self._admin else \
                "this server has no admin key (start it with --admin-key to use this route)"
            raise APIError(403, f"{why}; an API key may not administer the cache", None, "admin_key_required",
                           "permission_error")
        return Principal(tenant=tenant)


def request_tenant(principal: Principal | None, headers, body: dict | None) -> str | None:
    """The tenant a generation request runs as, to hand to
    :func:`~hybridkv.serve.protocol.parse_generation` as its header value: the key's bound
    tenant, or else the request's ``X-Tenant`` header (``None``: none).

    Raises:
        APIError: 403 (``tenant_mismatch``) when the key is bound to a tenant and the ``X-Tenant``
            header or the ``tenant`` field names another; 400 for two ``X-Tenant`` headers, or an
            empty one or an empty ``tenant`` field (:func:`~hybridkv.serve.protocol.check_tenant`).
    """
    header = tenant_header(headers)
    field = body.get("tenant") if isinstance(body, dict) else None
    check_tenant(field, "the tenant field")
    if principal is None or principal.tenant is None:
        return header
    for claim, where in ((header, "the X-Tenant header"), (field, "the tenant field")):
        if claim is not None and claim != principal.tenant:
            raise APIError(403, f"{where} names another tenant than this API key is bound to; a key may act only "
                                "for its own tenant", "tenant", "tenant_mismatch", "permission_error")
    return principal.tenant


INVALIDATE_FIELDS = ("tenant", "cache_salt", "adapter", "adapter_version", "all", "abi_version")
"""The fields of a ``POST /admin/cache/invalidate`` body (any other is refused)."""


def invalidate_scope(body: dict, principal: Principal | None, headers) -> tuple[dict, str | None]:
    """The scope of a ``POST /admin/cache/invalidate`` body as ``hybridkv router`` checks it before
    sending it to its workers, by the workers' own rules (``hybridkv serve``'s route): the body to
    send (its scope fields only) and the tenant it is confined to (to send as ``X-Tenant``;
    ``None``: not confined).

    Args:
        body: the decoded JSON object.
        principal: the caller (:func:`principal_of`; ``None``: no keys checked).
        headers: the request's headers (a bound key's ``X-Tenant`` must name its own tenant; without
            a bound key, an ``X-Tenant`` header confines the purge to that tenant).

    Raises:
        APIError: 400 for an unknown field, a field of the wrong type, an empty ``tenant`` or
            ``cache_salt`` (``empty_tenant``, ``empty_cache_salt``), a ``tenant`` or ``cache_salt``
            over 256 characters, a ``cache_salt`` without a tenant (``salt_needs_tenant``: its
            namespaces are digests of tenant and salt, so no store listing reaches them by salt),
            an empty ``adapter`` (``empty_adapter``), an ``adapter`` without a tenant
            (``adapter_needs_tenant``, for the same reason), an ``adapter_version`` without an
            ``adapter``, or not exactly one scope; 403 when a bound key (or an ``X-Tenant`` request) names
            another tenant, ``all`` or ``abi_version``.
    """
    from hybridkv.cache.abi import ABI_VERSION as abi_current

    unknown = next((name for name in body if name not in INVALIDATE_FIELDS), None)
    if unknown is not None:           # a misspelt scope field would widen the purge
        raise APIError(400, f"unknown field {_shown(unknown)} in a /admin/cache/invalidate request (fields: "
                            f"{', '.join(INVALIDATE_FIELDS)})", unknown, "unknown_field")
    everything = body.get("all", False)
    tenant, salt, abi = body.get("tenant"), body.get("cache_salt"), body.get("abi_version")
    adapter, version = body.get("adapter"), body.get("adapter_version")
    if not isinstance(everything, bool):
        raise APIError(400, f"all={everything!r} must be a boolean", "all")
    for name, value in (("tenant", tenant), ("cache_salt", salt), ("adapter", adapter),
                        ("adapter_version", version)):
        if value is not None and not isinstance(value, str):
            raise APIError(400, f"{name}={_shown(value)} must be a string", name)
        if value is not None and len(value) > MAX_ID_LEN:      # the cap of a completion request's fields
            raise APIError(400, f"{name} has {len(value)} characters; at most {MAX_ID_LEN} are allowed", name)
    check_tenant(tenant, "the tenant field")
    if abi is not None and (isinstance(abi, bool) or not isinstance(abi, int) or not 1 <= abi < abi_current):
        raise APIError(400, f"abi_version={abi!r} must be an older cache ABI version: an integer from 1 to "
                            f"{abi_current - 1} (v{abi_current}, the current one, is purged by tenant, cache_salt "
                            "or all)", "abi_version")
    bound = principal.tenant if principal is not None else None
    confined = request_tenant(principal, headers, None)      # a bound key's tenant, else X-Tenant
    if confined is not None:
        if everything or abi is not None or (tenant is not None and tenant != confined):
            who = "a key bound to a tenant" if bound is not None else \
                f"a request with the X-Tenant header {_shown(confined)}"
            raise APIError(403, f"{who} may invalidate only that tenant's entries (no other tenant, all or "
                                "abi_version)", "tenant", "tenant_scope", "permission_error")
        tenant = confined
    if salt == "":                    # "" is every unsalted entry of every tenant, not a salt
        raise APIError(400, f"cache_salt is empty (''); name a salt of 1 to {MAX_ID_LEN} characters, or leave "
                            "it out", "cache_salt", "empty_cache_salt")
    if int(everything) + (tenant is not None or salt is not None or adapter is not None) + (abi is not None) != 1:
        raise APIError(400, "give exactly one scope: tenant and/or cache_salt, all=true, or abi_version")
    if adapter == "":                 # "" is the entries of no adapter, which the tenant scope names
        raise APIError(400, f"adapter is empty (''); name an adapter of 1 to {MAX_ID_LEN} characters, or leave it "
                            "out", "adapter", "empty_adapter")
    if version is not None and adapter is None:
        raise APIError(400, f"adapter_version={_shown(version)} needs an adapter name", "adapter_version")
    if adapter is not None and tenant is None:      # like a salt: a digest of tenant and adapter
        raise APIError(400, f"adapter={_shown(adapter)} needs a tenant: an adapter's entries are found by the "
                            "digest of tenant, salt and adapter; give the tenant with it ({\"tenant\": T, "
                            "\"adapter\": A}) or use all=true", "adapter", "adapter_needs_tenant")
    if salt is not None and tenant is None:   # a salted namespace is a digest of tenant and salt: no
        # store listing finds it by salt, so only this process's own namespaces would be purged
        raise APIError(400, f"cache_salt={_shown(salt)} needs a tenant: salted entries are found by the digest of "
                            "tenant and salt, so a salt alone misses those other or earlier processes stored; give "
                            "the tenant with it ({\"tenant\": T, \"cache_salt\": S}) or use all=true",
                       "cache_salt", "salt_needs_tenant")
    scope = {k: v for k, v in (("tenant", tenant), ("cache_salt", salt), ("adapter", adapter),
                               ("adapter_version", version), ("abi_version", abi)) if v is not None}
    return (scope | ({"all": True} if everything else {})), confined


def _shown(value: object) -> str:
    """``repr(value)``, shortened to 60 characters (a huge field is not echoed whole)."""
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def principal_of(request) -> Principal | None:
    """The :class:`Principal` :class:`AuthMiddleware` set on a Starlette ``request`` (``None``
    on an app without the middleware)."""
    return getattr(request, "scope", {}).get("hybridkv.principal")


class AuthMiddleware:
    """ASGI middleware: checks each HTTP request's key against ``ring`` for its route's group
    (``route_kind(path)``) and answers an OpenAI-shaped 401 or 403 itself, or passes the request
    on with its :class:`Principal` in the ASGI scope (:func:`principal_of`). Pure ASGI, so
    streamed answers and disconnects pass through untouched.

    Args:
        app: the ASGI app.
        ring: the keys.
        route_kind: path -> group (:func:`serve_route_kind`, :func:`router_route_kind`).
        on_refusal: called with the HTTP status of each refusal (a metrics counter), or ``None``.
    """

    def __init__(self, app, ring: KeyRing, route_kind, on_refusal=None) -> None:
        self.app, self.ring, self.route_kind, self.on_refusal = app, ring, route_kind, on_refusal

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from starlette.datastructures import Headers
        from starlette.responses import JSONResponse

        try:
            principal = self.ring.check(Headers(scope=scope), self.route_kind(scope["path"]))
        except APIError as exc:
            if self.on_refusal is not None:
                self.on_refusal(exc.status)
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
            await JSONResponse(exc.body(), status_code=exc.status, headers=headers)(scope, receive, send)
            return
        scope["hybridkv.principal"] = principal
        await self.app(scope, receive, send)


def read_keys_file(path: str) -> dict[str, str | None]:
    """The keys of ``--api-keys-file``: a JSON or YAML mapping key -> tenant (a string, or
    ``null`` for a key bound to no tenant), or a list of keys (bound to none).

    A key given twice is refused (a JSON or YAML parser would keep the last silently, so a key
    bound to a tenant and then to ``null`` would be widened to any tenant).

    Raises:
        ValueError: the file cannot be read or parsed, holds something else, or gives a key twice
            (naming the file and the entries' positions, never a key).
    """
    where = f"--api-keys-file {path}"

    def pairs(items: list) -> dict:
        """A JSON object's or YAML mapping's ``(key, value)`` pairs as a dict, a repeated key refused."""
        out: dict = {}
        for i, (key, value) in enumerate(items):
            if isinstance(key, (list, dict)):     # a YAML key that is a list or mapping cannot be hashed
                raise ValueError(f"{where}: entry {i + 1}: a key must be a non-empty string")
            if key in out:
                first = next(j for j, (k, _) in enumerate(items) if k == key)
                raise ValueError(f"{where}: entry {i + 1} gives the same key as entry {first + 1}; give each key "
                                 "once")
            out[key] = value
        return out

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        data = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError:
        try:
            import yaml
        except ImportError:
            raise ValueError(f"{where}: not valid JSON (YAML needs PyYAML: pip install pyyaml)") from None
        try:
            data = yaml.load(text, Loader=_unique_key_loader(yaml, pairs))
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark is not None else ""
            raise ValueError(f"{where}: neither valid JSON nor valid YAML{at}") from None
    if isinstance(data, list):
        for i, key in enumerate(data):
            check_key(key, f"{where}: entry {i + 1}")      # before hashing: a nested list is named, not a TypeError
        data = pairs([(key, None) for key in data])
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{where}: must hold a non-empty mapping of API key to tenant (or a list of keys)")
    for i, (key, tenant) in enumerate(data.items()):
        check_key(key, f"{where}: entry {i + 1}")
        if tenant == "":
            raise ValueError(f"{where}: entry {i + 1}: the tenant is empty (''); give a tenant of 1 to {MAX_ID_LEN} "
                             "characters, or null for a key bound to no tenant")
        if tenant is not None and (not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_ID_LEN):
            raise ValueError(f"{where}: entry {i + 1}: the tenant must be a string of 1 to {MAX_ID_LEN} characters "
                             "or null")
    return data


def _unique_key_loader(yaml, pairs):
    """A PyYAML ``SafeLoader`` subclass whose mappings are built by ``pairs`` (which refuses a
    repeated key) instead of keeping the last value silently."""

    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        loader.flatten_mapping(node)
        return pairs([(loader.construct_object(k, deep=deep), loader.construct_object(v, deep=deep))
                      for k, v in node.value])

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return UniqueKeyLoader


def keyring_from_options(api_keys: list[str] | None, keys_file: str | None, admin_key: str | None,
                         environ=os.environ) -> KeyRing:
    """The :class:`KeyRing` of the ``--api-key`` (repeatable), ``--api-keys-file`` and
    ``--admin-key`` options; :data:`API_KEY_ENV` and :data:`ADMIN_KEY_ENV` stand in for an
    option not given.

    Raises:
        ValueError: a bad key or file (see :func:`read_keys_file`, :class:`KeyRing`), or a key
            given both bound to a tenant in the file and unbound with ``--api-key``.
    """
    given = list(api_keys or [])
    if not given and keys_file is None and environ.get(API_KEY_ENV):
        given = [environ[API_KEY_ENV]]
    keys: dict[str, str | None] = {}
    for i, key in enumerate(given):
        keys[check_key(key, f"--api-key (occurrence {i + 1})")] = None
    if keys_file is not None:
        for i, (key, tenant) in enumerate(read_keys_file(keys_file).items()):
            if key in keys and keys[key] != tenant:
                raise ValueError(f"--api-keys-file {keys_file}: entry {i + 1} is also given with --api-key, bound "
                                 "to no tenant; give each key once")
            keys[key] = tenant
    admin = admin_key if admin_key is not None else environ.get(ADMIN_KEY_ENV) or None
    if admin is not None:
        check_key(admin, "--admin-key")
    return KeyRing(keys, (admin,) if admin is not None else ())


def worker_key_from_option(key: str | None, environ=os.environ) -> str | None:
    """The router's ``--worker-key`` (or :data:`WORKER_KEY_ENV`), checked; ``None``: none.

    Raises:
        ValueError: not printable ASCII without spaces (the key is not shown).
    """
    key = key if key is not None else environ.get(WORKER_KEY_ENV) or None
    return check_key(key, "--worker-key") if key is not None else None


def add_auth_arguments(parser, router: bool) -> None:
    """Add ``--api-key``, ``--api-keys-file`` and ``--admin-key`` (and, for the router,
    ``--worker-key``) to an argparse ``parser`` of ``hybridkv serve`` or ``hybridkv router``."""
    what = "the router" if router else "the server"
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help=f"an API key {what} accepts as 'Authorization: Bearer KEY' (the openai client's api_key) "
                             "on /v1/*" + ("" if router else " and the SGLang metadata and load routes") +
                             "; repeat for several; such a key may name any tenant. Without any API key the API is "
                             f"open (said at start). Default: ${API_KEY_ENV} if set")
    parser.add_argument("--api-keys-file", default=None, metavar="PATH",
                        help="a JSON or YAML file mapping each API key to the tenant it is bound to (null: none; a "
                             "list: keys bound to none); a bound key's requests are its tenant's, and a request "
                             "naming another tenant (X-Tenant header or tenant field) is refused with 403"
                             + ("; such a key may invalidate its own tenant's entries on every worker "
                                "(POST /admin/cache/invalidate)" if router else
                                "; such a key reads its own tenant's /get_load figures only and may invalidate its "
                                "own tenant's entries"))
    admin_routes = "/router/stats, /flush_cache and /admin/cache/invalidate (sent to every worker)" if router \
        else "/admin/*, /flush_cache and /v1/cache/* (the event feed)"
    parser.add_argument("--admin-key", default=None, metavar="KEY",
                        help=f"the key for {admin_routes}, also accepted on the API with any tenant; without it "
                             "these routes are open when no API key is given either, else refused"
                             + " (a key bound to a tenant may still POST /admin/cache/invalidate for its own "
                               "tenant's entries). "
                             + ("/health never needs a key" if router else
                                "/health never needs a key; /metrics needs one once API keys are given (the admin "
                                "key or a key bound to no tenant)") +
                             f". Default: ${ADMIN_KEY_ENV} if set")
    if router:
        parser.add_argument("--worker-key", default=None, metavar="KEY",
                            help="the key the router sends to every worker (their --admin-key): it reads their "
                                 "event feeds with it and forwards each request and purge with it, naming the "
                                 f"client's tenant in X-Tenant. Default: ${WORKER_KEY_ENV} if set; none: a client's own "
                                 "Authorization header is forwarded")


def forwarded_headers(request, body: dict | None, names: tuple[str, ...], worker_key: str | None) -> dict[str, str]:
    """The headers ``hybridkv router`` sends a worker with a client's request: those of ``names``
    (lower case) the client sent, with ``X-Tenant`` set to the tenant the client's key is bound to
    (:func:`request_tenant`) and, with a ``worker_key``, without the client's ``Authorization``
    (the router's HTTP client sends its own).

    Raises:
        APIError: 403 when the client's key is bound to a tenant and the request names another;
            400 for two ``X-Tenant`` headers.
    """
    tenant = request_tenant(principal_of(request), request.headers, body)
    headers = {k: v for k, v in request.headers.items() if k.lower() in names}
    if worker_key is not None:
        headers.pop("authorization", None)
    if tenant is not None:
        headers["x-tenant"] = tenant
    return headers

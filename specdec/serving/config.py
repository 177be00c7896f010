"""The one YAML configuration file: models, placement, ports and speculation settings,
validated at load with errors that name the offending key."""
from __future__ import annotations

import dataclasses
import functools
import json
import typing
from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    TypeAdapter,
    ValidationError,
)
from pydantic.dataclasses import dataclass

from specdec.core.engine import QUANTIZED, WEIGHT_FORMATS
from specdec.core.feature_head import is_feature_head
from specdec.core.feature_head import read_meta as read_feature_meta
from specdec.core.hub import BUILTIN_FEATURE_HEAD, BUILTIN_SMOLLM2
from specdec.core.models import AUTO, ModelSpec
from specdec.core.ngram import NgramSettings, is_model_free
from specdec.core.oracle import NOT_SERVED as ORACLE_NOT_SERVED
from specdec.core.oracle import ORACLE
from specdec.core.steering import is_steering_checkpoint_for
from specdec.core.tree import MAX_DRAFT_NODES, NGRAM_METHODS, TREE_METHODS, TreeShape
from specdec.serving.latency_proxy import LinkSettings


class ConfigError(ValueError):
    pass


# Every settings class (these and the training recipes) is a pydantic dataclass built with
# `settings`: unknown keys are refused, and strict types keep a quoted "8" from passing as 8.
settings = functools.partial(dataclass, config=ConfigDict(extra="forbid", strict=True))

Port = Annotated[int, Field(ge=0, le=65535)]


def _model_spec(value: Any) -> Any:
    return {"source": value} if isinstance(value, str) else value


Model = Annotated[ModelSpec, BeforeValidator(_model_spec)]  # "model: NAME" is short for {source: NAME}


@settings
class ServiceConfig:
    model: Model
    host: str = "0.0.0.0"
    port: Port = 0  # 0 = any free port (the coordinator finds it)
    torch_threads: NonNegativeInt = 0  # 0 = one per core
    ray_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0})
    num_replicas: PositiveInt = 1  # Ray Serve replicas, when not autoscaling
    # Ray Serve autoscaling_config ({} = num_replicas, fixed). The sessions a replica holds drive
    # it with policy {policy_function: specdec.serving.autoscaling:SessionsPolicy} (deploy/serve.yaml).
    autoscaling: dict[str, Any] = field(default_factory=dict)


@settings
class DrafterConfig(ServiceConfig):
    # One thread: its tiny forwards barely gain from a second, and on a machine it shares with
    # the verifier an idle OpenMP worker of its own spins on the core the verifier needs next
    # (chain-4 through Ray Serve on 2 cores: 38-51 -> 55-67 tokens/s).
    torch_threads: NonNegativeInt = 1
    proposal_top_k: PositiveInt = 32  # support size of the sparse proposal sent with sampled drafts
    # model: prompt-lookup or suffix drafts without a model; with a model, ngram.method adds
    # n-gram candidates to its drafts (hybrid).
    ngram: NgramSettings = field(default_factory=NgramSettings)
    # Staged speculation: an n-gram second stage guesses this many tokens of the drafter's own
    # draft, checked in the forwards it runs anyway (fewer forwards, the same draft); 0 = off.
    staged_lookahead: int = 0
    # "shared": the drafter's tokenizer must be the verifier's. "own": a model drafter of another
    # tokenizer; the drafter service maps its drafts to the verifier's tokens through text.
    tokenizer: Literal["shared", "own"] = "shared"


@settings
class VerifierConfig(ServiceConfig):
    """The verifier's settings (what one call may ask of it is in `limits`)."""

    # Prompt prefixes kept for sessions that start alike (a system prompt, a repeated prompt):
    # their keys and values are copied, not computed again. Native engine only; 0 = none.
    prefix_cache_mib: NonNegativeFloat = 256.0


@settings
class LimitsConfig:
    """Every bound on what a request or a service may take, in one place: past one, a call is
    refused (INVALID_ARGUMENT, RESOURCE_EXHAUSTED) before any heavy work."""

    max_draft_tokens: PositiveInt = MAX_DRAFT_NODES  # draft tree nodes per round; also caps tree width, branching and depth
    max_tree_nodes: PositiveInt = 256  # nodes of a tree sent straight to the verifier in one call
    max_fused_tokens: PositiveInt = 64  # tokens one verifier-only call may ask for
    max_new_tokens: PositiveInt = 2048  # per request
    max_concurrent_requests: PositiveInt = 32  # at the coordinator; more at once get RESOURCE_EXHAUSTED, not a queue
    max_stop_strings: NonNegativeInt = 16  # per request
    max_stop_string_chars: PositiveInt = 256  # per stop string
    max_sessions: PositiveInt = 64  # KV caches each service keeps; the least recently used is evicted
    session_ttl_s: PositiveFloat = 600.0  # a session idle this long is dropped
    max_kv_mib: PositiveFloat = 4096.0  # KV cache memory of all sessions of a service; past it the least recently used are evicted
    max_session_kv_mib: PositiveFloat = 1024.0  # one session's KV cache; a call growing it past this gets RESOURCE_EXHAUSTED
    max_request_mib: PositiveFloat = 4.0  # a client's request message (a prompt within the context is far smaller)
    # A message between the services; the largest are a re-opened session's verifier features
    # (context x hidden size x 2 bytes: 9 MiB for the default pair at its full 8k context).
    max_message_mib: PositiveFloat = 64.0
    # Structured outputs: a constraint's text (a JSON schema, regex, grammar or choices); its
    # compile work is bounded by llguidance's own parser limits (a grammar past them is refused).
    max_constraint_bytes: PositiveInt = 65536


@settings
class NetworkConfig:
    """Emulated links between the coordinator and each service (latency_proxy.py); all
    zero = direct connections."""

    drafter: LinkSettings = field(default_factory=LinkSettings)
    verifier: LinkSettings = field(default_factory=LinkSettings)


@settings
class AdaptiveConfig:
    """The cost-model budget controller (coordinator/budget.py)."""

    # The default for requests that neither say nor name a plan (num_draft_tokens or tree): the
    # controller runs the verifier alone wherever speculation does not pay (docs/network.md).
    enabled: bool = True
    chain_budgets: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    tree_budgets: list[int] = field(default_factory=lambda: [16, 32])
    tree_method: Literal[TREE_METHODS] = "rsd-s"  # shaped by coordinator.tree's branching/width
    hybrid_budgets: list[int] = field(default_factory=list)  # chains with n-gram candidates merged in
    hybrid_ngram: Literal[NGRAM_METHODS] = "suffix"  # the n-gram method of those plans
    revisit_every: Annotated[int, Field(ge=2)] = 64  # every this many rounds, the plan measured longest ago is tried again


@settings
class AuthConfig:
    """Bearer tokens the client API accepts (`authorization: Bearer <token>`); none = open."""

    tokens: list[str] = field(default_factory=list)
    tokens_file: str = ""  # one token per line, read at start (blank lines and # comments skipped)
    # What the coordinator shows the drafter and the verifier, which refuse calls without it.
    # "" = none for plain servers; under Ray Serve a random one per deployment of the app.
    service_token: str = ""

    def accepted(self) -> set[str]:
        """Every accepted token; raises ValueError naming a file that cannot be read or is empty."""
        tokens = set(self.tokens)
        if self.tokens_file:
            try:
                lines = Path(self.tokens_file).read_text().splitlines()
            except OSError as err:
                raise ValueError(f"coordinator.auth.tokens_file: cannot read {self.tokens_file}: {err.strerror}") from None
            from_file = {line.strip() for line in lines if line.strip() and not line.strip().startswith("#")}
            if not from_file:
                raise ValueError(f"coordinator.auth.tokens_file {self.tokens_file} holds no token")
            tokens |= from_file
        return tokens


@settings
class TlsConfig:
    """TLS on the client gRPC API: a PEM certificate and its key; none = plaintext."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""  # what this project's own clients (start-up health check, demo) trust; "" = cert_file

    def __post_init__(self) -> None:
        _both_or_neither(self, "cert_file", "key_file")

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    def read(self) -> tuple[bytes, bytes]:
        """(key, certificate) bytes; raises ValueError naming a file that cannot be read."""
        return _read("coordinator.tls.key_file", self.key_file), _read("coordinator.tls.cert_file", self.cert_file)

    def trusted(self) -> bytes:
        """The root certificates a client of this server checks it against."""
        return _read("coordinator.tls.ca_file", self.ca_file or self.cert_file)


@settings
class ServiceTlsConfig:
    """TLS on the links between the coordinator and the services (PEM files, or PEM text inline);
    none = plaintext, which suits a single node only (on a cluster `specdec serve --ray-address`
    makes the app certificates of its own). The services present cert_file/key_file, which the
    coordinator checks against ca_file under server_name; with client_cert_file/client_key_file
    the services also require the coordinator's certificate, signed by ca_file (mutual TLS).
    The service token is asked for as well."""

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""
    server_name: str = ""  # the name the services' certificate carries; "" = the host dialed
    client_cert_file: str = ""
    client_key_file: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file)

    @property
    def mutual(self) -> bool:
        return bool(self.client_cert_file)

    def server_credentials(self) -> tuple[tuple[bytes, bytes], bytes | None]:
        """((key, certificate), the CA clients must be signed by, or None)."""
        pair = _read("coordinator.service_tls.key_file", self.key_file), _read("coordinator.service_tls.cert_file", self.cert_file)
        return pair, _read("coordinator.service_tls.ca_file", self.ca_file) if self.mutual else None

    def channel_credentials(self):
        import grpc

        mine = (_read("coordinator.service_tls.client_key_file", self.client_key_file),
                _read("coordinator.service_tls.client_cert_file", self.client_cert_file)) if self.mutual else (None, None)
        return grpc.ssl_channel_credentials(_read("coordinator.service_tls.ca_file", self.ca_file), *mine)

    def __post_init__(self) -> None:
        _both_or_neither(self, "cert_file", "key_file")
        _both_or_neither(self, "client_cert_file", "client_key_file")
        if (self.mutual or self.server_name or self.ca_file) and not self.enabled:
            raise ValueError("sets client certificates, server_name or ca_file without cert_file and key_file")
        if self.enabled and not self.ca_file:
            raise ValueError("needs ca_file: the CA that signed cert_file, which the coordinator checks the services against")


def _both_or_neither(settings, first: str, second: str) -> None:
    """A certificate comes with its key: raises ValueError when one of the two is set alone."""
    if bool(getattr(settings, first)) != bool(getattr(settings, second)):
        raise ValueError(f"needs both {first} and {second} (or neither)")


def _read(key: str, path: str) -> bytes:
    """A PEM file's bytes, or the PEM text given inline (the certificates an app on a cluster
    makes for itself: specdec/serving/certificates.py)."""
    if path.lstrip().startswith("-----BEGIN"):
        return path.encode()
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{key}: cannot read {path}: {err.strerror}") from None


@settings
class CoordinatorConfig:
    host: str = "0.0.0.0"
    port: Port = 50051
    num_draft_tokens: int = 4  # the speculation budget per round: draft tree nodes
    tree: TreeShape = field(default_factory=TreeShape)  # how the drafter spends the budget
    fused_block_tokens: PositiveInt = 8  # tokens per call when the verifier generates alone
    default_max_new_tokens: int = 128  # limits.max_new_tokens caps what a request may ask
    request_timeout_s: PositiveFloat = 120.0  # what one call to a service may take, retries aside
    # Where the services listen when run without Ray (host:port); under Ray Serve the
    # coordinator asks the deployments.
    drafter_address: str | None = None
    verifier_address: str | None = None
    # A drafter without a model (prompt-lookup, suffix) runs inside the coordinator: no drafter
    # service and no drafter round trip per round.
    drafter_in_process: bool = False
    # The verifier runs inside each coordinator replica, on the verifier's placement: a round
    # crosses the network once, to the drafter (target-driven placement).
    verifier_in_process: bool = False
    network: NetworkConfig = field(default_factory=NetworkConfig)
    overlap: bool = False  # draft the next round while the verifier checks this one (PEARL)
    steering: bool = True  # SD²: requests steer the drafter by default whenever the pair has a steering checkpoint
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    service_tls: ServiceTlsConfig = field(default_factory=ServiceTlsConfig)  # the links to the drafter and verifier
    ray_actor_options: dict[str, Any] = field(default_factory=lambda: {"num_cpus": 0})
    num_replicas: PositiveInt = 1  # Ray Serve replicas; they share the client port (SO_REUSEPORT)
    # Ray Serve autoscaling_config ({} = num_replicas), on the requests through Serve's proxies
    autoscaling: dict[str, Any] = field(default_factory=dict)


@settings
class Config:
    # By measurement on CPU (docs/engine.md): the verifier in its GGUF file's own 4-bit blocks
    # (q4_1) decodes alone 1.30x faster through the services than int8 and agrees with float32
    # more closely; the drafter, the verifier-feature head, int8 (its step ~6x float32's; it
    # keeps about twice the SD² drafter's tokens, docs/feature_head.md).
    verifier: VerifierConfig = field(default_factory=lambda: VerifierConfig(ModelSpec(BUILTIN_SMOLLM2, dtype="q4_1")))
    drafter: DrafterConfig = field(default_factory=lambda: DrafterConfig(ModelSpec(BUILTIN_FEATURE_HEAD, dtype="int8")))
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    # SD²: a checkpoint from `specdec distill --steering`; each service loads its own half.
    # null = the drafter's own directory when it is one made for this verifier; "" = none.
    steering_checkpoint: str | None = None

    def resolved_steering_checkpoint(self) -> str | None:
        if self.steering_checkpoint is not None:
            return self.steering_checkpoint or None
        drafter = self.drafter.model.source
        return drafter if is_steering_checkpoint_for(drafter, self.verifier.model.source) else None

    def resolved_feature_checkpoint(self) -> str | None:
        """A feature-head drafter reads features the verifier fuses with the same checkpoint,
        when the head was trained on this verifier (a config that names only another verifier
        keeps the default head out of it; the pair check then names the mismatch)."""
        drafter = self.drafter.model.source
        if not is_feature_head(drafter) or read_feature_meta(drafter)["base_model"] != self.verifier.model.source:
            return None
        return drafter

    def service_args(self, service: str) -> dict:
        """What a service takes besides its section: `start(section, **config.service_args(name))`,
        the limits and the checkpoints it loads besides its model."""
        args = {
            "limits": self.limits, "steering_checkpoint": self.resolved_steering_checkpoint(),
            "service_token": self.coordinator.auth.service_token, "tls": self.coordinator.service_tls,
        }
        if service == "verifier":
            args["feature_checkpoint"] = self.resolved_feature_checkpoint()
        else:
            args["verifier_tokenizer"] = self.verifier.model.source if self.drafter.tokenizer == "own" else None
        return args

    def __post_init__(self):
        """The checks that relate keys to each other (each key's own range is in its type)."""
        limits = self.limits
        checks = [
            (limits.max_draft_tokens <= limits.max_tree_nodes, "limits.max_draft_tokens must be <= limits.max_tree_nodes"),
            (limits.max_session_kv_mib <= limits.max_kv_mib, "limits.max_session_kv_mib must be <= limits.max_kv_mib"),
            (
                self.coordinator.fused_block_tokens <= limits.max_fused_tokens,
                "coordinator.fused_block_tokens must be <= limits.max_fused_tokens",
            ),
            (
                all(t.strip() == t and t for t in self.coordinator.auth.tokens),
                "coordinator.auth.tokens must be non-empty, without surrounding spaces",
            ),
            (
                1 <= self.coordinator.default_max_new_tokens <= limits.max_new_tokens,
                "coordinator.default_max_new_tokens must be in [1, limits.max_new_tokens]",
            ),
            (
                0 <= self.coordinator.num_draft_tokens <= limits.max_draft_tokens,
                f"coordinator.num_draft_tokens must be in [0, {limits.max_draft_tokens}] (limits.max_draft_tokens; 0 = verifier only)",
            ),
            (
                all(
                    1 <= b <= limits.max_draft_tokens
                    for b in self.coordinator.adaptive.chain_budgets + self.coordinator.adaptive.tree_budgets
                    + self.coordinator.adaptive.hybrid_budgets
                ),
                f"coordinator.adaptive budgets must be in [1, {limits.max_draft_tokens}] (limits.max_draft_tokens)",
            ),
        ]
        for name in ("drafter", "verifier"):
            service = getattr(self, name)
            checks += [
                (service.model.layers is None or service.model.layers >= 1, f"{name}.model.layers must be >= 1"),
                (service.model.draft_vocab >= 0, f"{name}.model.draft_vocab must be >= 0 (0 = the whole vocabulary)"),
                (
                    service.model.dtype in (*WEIGHT_FORMATS, AUTO),
                    f"{name}.model.dtype must be one of {', '.join(WEIGHT_FORMATS)} or {AUTO}",
                ),
                (
                    service.model.dtype not in QUANTIZED or service.model.device == "cpu",
                    f"{name}.model.dtype {service.model.dtype} runs on the CPU; on {service.model.device} use bfloat16",
                ),
                (
                    service.model.dtype != AUTO or service.model.device == "cpu",
                    f"{name}.model.dtype auto picks the fastest of the CPU's exact formats; on {service.model.device} name one: bfloat16",
                ),
            ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        for name in ("drafter", "verifier", "coordinator"):
            if getattr(self, name).autoscaling:
                _check_autoscaling(name, getattr(self, name).autoscaling)
        try:  # the certificate files are read where the coordinator starts (other nodes may lack them)
            self.coordinator.auth.accepted()
        except ValueError as err:
            raise ConfigError(str(err)) from None
        drafter = self.drafter.model.source
        if self.verifier.model.draft_vocab:
            raise ConfigError(
                "verifier.model.draft_vocab: the verifier decides over the whole vocabulary; a draft vocabulary is a drafter's"
            )
        if self.drafter.model.draft_vocab and (is_model_free(drafter) or is_feature_head(drafter)):
            raise ConfigError(
                "drafter.model.draft_vocab cuts a drafter model's head; this drafter has none (n-gram) or its own (feature head)"
            )
        if drafter == ORACLE:  # the bench deploys the oracle from the reference table it recorded; the name alone has nothing to draft
            raise ConfigError(f"drafter.model: {ORACLE_NOT_SERVED}")
        if self.drafter.model.dtype == AUTO and is_feature_head(drafter):
            raise ConfigError(
                "drafter.model.dtype auto picks a drafter model's fastest exact format; a feature head runs float32 or int8: name one"
            )
        if self.drafter.staged_lookahead and (is_model_free(drafter) or is_feature_head(drafter)):
            raise ConfigError(
                "drafter.staged_lookahead speeds up a drafter model's own drafting; this drafter has none (n-gram) or is a feature head"
            )
        if not 0 <= self.drafter.staged_lookahead <= limits.max_draft_tokens:
            raise ConfigError("drafter.staged_lookahead must be in [0, limits.max_draft_tokens]")
        if self.drafter.tokenizer == "own" and (is_model_free(drafter) or is_feature_head(drafter)):
            raise ConfigError(
                "drafter.tokenizer: own maps a drafter model's own tokens to the verifier's; this drafter has no tokenizer "
                "(n-gram: it drafts the verifier's tokens already) or is a feature head (it reads the verifier's positions)"
            )
        if self.drafter.tokenizer == "own" and self.resolved_steering_checkpoint():
            raise ConfigError("drafter.tokenizer: own takes no steering checkpoint: SD² steers a drafter trained on the verifier's tokens")
        if self.coordinator.drafter_in_process and not is_model_free(drafter):
            raise ConfigError("coordinator.drafter_in_process needs a drafter without a model: drafter.model prompt-lookup or suffix")
        if self.coordinator.verifier_in_process and self.coordinator.network.verifier.active:
            raise ConfigError(
                "coordinator.network.verifier emulates a link to a verifier that coordinator.verifier_in_process runs "
                "in the coordinator's own process: set one of them"
            )
        if self.drafter.ngram.method and is_model_free(drafter):
            raise ConfigError("drafter.ngram.method is for a model drafter (hybrid); a model-free drafter is chosen by drafter.model")
        try:
            self.coordinator.tree.check_limit(limits.max_draft_tokens)
        except ValueError as err:
            raise ConfigError(f"coordinator.tree: {err}") from None


def _check_autoscaling(name: str, settings: dict) -> None:
    """Serve's own schema, checked at load rather than at deploy time."""
    from ray.serve.config import AutoscalingConfig

    unknown = sorted(set(settings) - set(AutoscalingConfig.model_fields))
    if unknown:
        raise ConfigError(f"unknown key {name}.autoscaling.{unknown[0]}; see Ray Serve's autoscaling_config")
    try:
        AutoscalingConfig(**settings)
    except Exception as err:  # noqa: BLE001 - pydantic's ValidationError, or a TypeError
        raise ConfigError(f"{name}.autoscaling is not a valid Ray Serve autoscaling_config: {err}") from None


def parse(cls, data: Any, path: str = ""):
    """Settings class `cls` built from parsed YAML; unknown keys, wrong types and values out of
    range raise ConfigError naming the key's path (under `path`)."""
    try:  # as JSON: pydantic's strict mode takes mappings for nested settings only from JSON
        return _adapter(cls).validate_json(json.dumps(data, default=str))
    except ValidationError as err:
        raise ConfigError(_describe(cls, err.errors()[0], path)) from None


@functools.cache
def _adapter(cls) -> TypeAdapter:
    return TypeAdapter(cls)


def _describe(cls, error: dict, path: str) -> str:
    """One readable line for pydantic's first error: the key's path, what it must be, what it was."""
    keys = [path] if path else []
    keys += [f"[{k}]" if isinstance(k, int) else k for k in error["loc"]]
    where = ".".join(keys).replace(".[", "[")
    if error["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        allowed = ", ".join(f.name for f in dataclasses.fields(_class_at(cls, error["loc"][:-1])))
        return f"unknown key {where}; allowed: {allowed}"
    if error["type"] == "value_error":  # a check of our own, whose message names its keys
        message = str(error["ctx"]["error"])
        return f"{where}: {message}" if where else message
    message = error["msg"].replace("Input should be", "must be").replace("an object", "a mapping")
    return f"{where or 'the config'} {message}, got {error['input']!r}"


def _class_at(cls, keys: tuple) -> type:
    """The settings class found at `keys` below `cls`."""
    for key in keys:
        cls = typing.get_type_hints(cls)[key]
        cls = next((a for a in typing.get_args(cls) if dataclasses.is_dataclass(a)), cls)  # X | None
    return cls


def config_from_dict(data: dict | None, base: Config | None = None) -> Config:
    """Builds a Config from a mapping; keys it does not set keep their defaults (or `base`)."""
    return parse(Config, _merge(dataclasses.asdict(base or Config()), data or {}))


def load_config(path: str | Path | None) -> Config:
    if path is None:
        return Config()
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    try:
        return config_from_dict(data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def config_to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "ray_actor_options":
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out

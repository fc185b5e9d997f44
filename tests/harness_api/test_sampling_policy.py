"""The endpoint's sampling policy on its own (`sampling_policy.apply_policy`, pure):
honour is the identity, override always samples at the run's settings and names exactly
what it changed, refuse never lets a setting outside its ranges through; and ``[sampling]``
is checked where a config file is read, naming the field."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.faults import ConfigError
from fleetrl.harness.errors import ApiError
from fleetrl.harness.openai_request import EndpointConfig, chat_request
from fleetrl.harness.sampling_policy import (
    PARAMS,
    POLICIES,
    REFUSED_CODE,
    Applied,
    Override,
    SamplingPolicy,
    SamplingSettings,
    apply_policy,
    describe,
)


def _range(lo: float, hi: float):
    return st.tuples(st.floats(lo, hi), st.floats(lo, hi)).map(lambda t: (min(t), max(t)))


policies = st.builds(
    SamplingPolicy,
    policy=st.sampled_from(POLICIES),
    temperature=st.one_of(st.sampled_from([0.7, 1.0, 2.0]), st.floats(0.0, 2.0, exclude_min=True)),
    top_p=st.one_of(st.sampled_from([0.9, 1.0]), st.floats(0.0, 1.0, exclude_min=True)),
    top_k=st.one_of(st.none(), st.integers(2, 1000)),
    temperature_range=_range(0.0, 2.0),
    top_p_range=_range(0.0, 1.0),
    min_top_k=st.integers(1, 64),
)
"""Any valid policy (exact common values mixed in, so equal settings come up)."""

requests = st.builds(
    SamplingSettings,
    temperature=st.one_of(st.sampled_from([0.0, 0.7, 1.0, 2.0]), st.floats(0.0, 2.0)),
    top_p=st.one_of(st.sampled_from([0.9, 1.0]), st.floats(0.0, 1.0, exclude_min=True)),
    top_k=st.one_of(st.none(), st.integers(1, 2000)),
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
)
"""What the endpoint parses from any valid request (its defaults standing in for omitted ones)."""


@given(policies, requests)
def test_honour_is_the_identity(policy, req):
    policy = msgspec.structs.replace(policy, policy="honour")
    assert apply_policy(policy, req) == Applied(settings=req, overridden=())


@given(policies, requests)
def test_override_samples_at_the_policys_settings_and_names_exactly_what_changed(policy, req):
    policy = msgspec.structs.replace(policy, policy="override")
    got = apply_policy(policy, req)
    s = got.settings
    assert (s.temperature, s.top_p, s.top_k) == (policy.temperature, policy.top_p, policy.top_k)
    assert s.seed == req.seed  # the harness's seed is kept
    assert got.overridden == tuple(Override(p, getattr(req, p), getattr(s, p)) for p in PARAMS
                                   if getattr(req, p) != getattr(s, p))
    # a request that asks for the run's settings is sampled as it asked, and overrides nothing
    same = SamplingSettings(temperature=policy.temperature, top_p=policy.top_p, top_k=policy.top_k, seed=req.seed)
    assert apply_policy(policy, same) == Applied(settings=same, overridden=())


@given(policies, requests)
def test_refuse_never_lets_a_setting_outside_the_ranges_through(policy, req):
    policy = msgspec.structs.replace(policy, policy="refuse")
    t_lo, t_hi = policy.temperature_range
    p_lo, p_hi = policy.top_p_range
    inside = {"temperature": t_lo <= req.temperature <= t_hi, "top_p": p_lo <= req.top_p <= p_hi,
              "top_k": req.top_k is None or req.top_k >= policy.min_top_k}
    try:
        got = apply_policy(policy, req)
    except ApiError as err:
        assert (err.status, err.code, err.type) == (400, REFUSED_CODE, "invalid_request_error")
        first = next(p for p in PARAMS if not inside[p])  # the first offender, in the order of PARAMS
        assert err.param == first and err.message.startswith(f"{first} ")
        assert '(sampling policy "refuse")' in err.message
    else:
        assert all(inside.values())
        assert got == Applied(settings=req, overridden=())


def test_what_refuse_says():
    refuse = SamplingPolicy(policy="refuse")

    def refused(req: SamplingSettings, **kw) -> ApiError:
        with pytest.raises(ApiError) as info:
            apply_policy(refuse, req, **kw)
        return info.value

    greedy = refused(SamplingSettings(temperature=0.0))  # greedy is refused with the default range
    assert greedy.param == "temperature" and greedy.body["error"]["message"] == (
        'temperature 0.0 is outside this endpoint\'s allowed range [0.1, 2.0] (sampling policy "refuse")')
    assert refused(SamplingSettings(top_p=0.3)).message == (
        'top_p 0.3 is outside this endpoint\'s allowed range [0.5, 1.0] (sampling policy "refuse")')
    assert refused(SamplingSettings(top_k=1)).message == (
        'top_k 1 is below this endpoint\'s allowed minimum 2 (sampling policy "refuse")')
    assert refused(SamplingSettings(temperature=0.0, top_p=0.3, top_k=1)).param == "temperature"
    assert refused(SamplingSettings(top_p=0.3, top_k=1)).param == "top_p"
    # an omitted parameter whose default is out of range: the message says it was the default
    narrow = SamplingPolicy(policy="refuse", temperature_range=(0.2, 0.8))
    with pytest.raises(ApiError) as info:
        apply_policy(narrow, SamplingSettings(), defaulted=("temperature", "top_p", "top_k"))
    assert info.value.message.startswith("temperature 1.0 (the default: the request sent none) is outside")
    # bounds are inclusive; no top_k cap is never too small
    assert apply_policy(refuse, SamplingSettings(temperature=0.1, top_p=0.5, top_k=2)).overridden == ()
    assert apply_policy(refuse, SamplingSettings(temperature=2.0, top_k=None)).overridden == ()


def test_what_override_counts_as_overridden():
    run = SamplingPolicy(policy="override", temperature=0.7, top_p=0.95, top_k=50)
    asked = apply_policy(run, SamplingSettings(temperature=0.7, top_p=0.95, top_k=50, seed=9))
    assert asked.overridden == () and asked.settings.seed == 9
    # omitted: the endpoint's defaults (temperature 1, top_p 1, no cap) differ from the run's, so they count
    omitted = apply_policy(run, SamplingSettings())
    assert describe(omitted.overridden) == "temperature=1.0->0.7, top_p=1.0->0.95, top_k=none->50"
    # omitted where the default is the run's setting: not overridden
    default_run = SamplingPolicy(policy="override")
    assert apply_policy(default_run, SamplingSettings()).overridden == ()
    got = apply_policy(default_run, SamplingSettings(temperature=0.0, top_p=0.9, top_k=40, seed=3))
    assert got.settings == SamplingSettings(temperature=1.0, top_p=1.0, top_k=None, seed=3)
    assert describe(got.overridden) == "temperature=0.0->1.0, top_p=0.9->1.0, top_k=40->none"


def test_the_request_carries_the_policys_answer():
    body = {"model": "fleetrl", "messages": [{"role": "user", "content": "x"}], "temperature": 0.7, "top_p": 0.9,
            "seed": 4}
    honour = chat_request(body, EndpointConfig()).common
    assert (honour.temperature, honour.top_p, honour.top_k, honour.seed, honour.overridden) == (0.7, 0.9, None, 4, ())
    assert honour.defaulted == ("top_k",)
    over = chat_request(body, EndpointConfig(sampling=SamplingPolicy(policy="override"))).common
    assert (over.temperature, over.top_p, over.top_k, over.seed) == (1.0, 1.0, None, 4)
    assert describe(over.overridden) == "temperature=0.7->1.0, top_p=0.9->1.0"
    refuse = EndpointConfig(sampling=SamplingPolicy(policy="refuse"))
    with pytest.raises(ApiError) as info:
        chat_request({**body, "temperature": 0}, refuse)
    assert (info.value.param, info.value.code) == ("temperature", REFUSED_CODE)
    # an invalid request is reported as such, not as a refusal
    with pytest.raises(ApiError) as info:
        chat_request({**body, "temperature": 0, "messages": []}, refuse)
    assert info.value.param == "messages"


@pytest.mark.parametrize(("toml", "named"), [
    ('policy = "bogus"', "sampling.policy"),
    ("temperature_range = [0.5, 0.1]", "temperature_range"),
    ("top_p_range = [0.5, 1.5]", "top_p_range"),
    ("temperature = 0", "sampling.temperature"),
    ("min_top_k = 0", "sampling.min_top_k"),
    ("colour = 1", "colour"),
])
def test_a_bad_sampling_section_is_refused_naming_the_field(toml, named):
    with pytest.raises(msgspec.ValidationError, match=named.replace(".", r"\.")):
        msgspec.toml.decode(f"[sampling]\n{toml}\n", type=EndpointConfig)
    # and where the daemon reads the endpoint actor's config: file, line and key
    text = f"""
[actors.endpoint]
factory = "fleetrl.actors.endpoint:run"
[actors.endpoint.config]
model = {{kind = "local", model_dir = "/nonexistent"}}
[actors.endpoint.config.sampling]
{toml}
"""
    with pytest.raises(ConfigError) as info:
        load_config_text(text, source="run.toml")
    assert str(info.value).startswith("run.toml:") and "actors.endpoint.config.sampling" in str(info.value)
    assert named.split(".")[-1] in str(info.value)


def test_a_good_sampling_section_decodes():
    cfg = msgspec.toml.decode('[sampling]\npolicy = "refuse"\ntemperature_range = [0, 1]\nmin_top_k = 1\n',
                              type=EndpointConfig)
    assert cfg.sampling == SamplingPolicy(policy="refuse", temperature_range=(0.0, 1.0), min_top_k=1)
    assert EndpointConfig().sampling.policy == "honour"

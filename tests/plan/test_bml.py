"""BML and hierarchical synthesis against seed 001: Algorithm 1, the Fig. 4 walk-through and the GST closed forms.

Expected values come from the paper's text (Fig. 4's state lists, copied verbatim; the per-step times of
§3.2; the closed forms), or are derived here from the definitions -- never from the implementation.
"""

from __future__ import annotations

import re

import pytest

from gradsync.errors import PlanError
from gradsync.plan import PlanOptions, evaluate
from gradsync.plan.bml import calc_gset, check_digits, piece_digits, piece_index
from gradsync.sim.choose import synthesize  # every synthesizer, and auto
from gradsync.topology import get_topology

#: Every BCube(n, k) with n >= 2, k >= 1 and N = n**k <= 64.
ALL_SMALL_BCUBES = [(n, k) for k in range(1, 7) for n in range(2, 65) if n**k <= 64]


def bml_gst(n: int, k: int) -> float:
    """Seed §3.2: 2 (N - 1) T_C with T_C = T_F / (k N)."""
    big_n = n**k
    return 2 * (big_n - 1) / (k * big_n)


def ps_gst(big_n: int) -> float:
    """Seed §2: P2P parameter server (and ring) on a non-blocking Fat-Tree, 2 (N - 1) / N T_F."""
    return 2 * (big_n - 1) / big_n


def cost(schedule, topology) -> float:
    """What ``evaluate(...).cost`` reports, without computing the topology's bounds (slow on large graphs)."""
    return schedule.link_loads(topology).cost(topology.costs)


# ---- an independent replay: contributor sets per (server, piece) after every step -----------------------
def replay(schedule, topology) -> list[dict[tuple[str, int], frozenset[str]]]:
    """States after each step: {(server name, chunk): servers whose gradient the server's copy sums}.

    Follows the schedule's documented semantics: transfers of one step read the state before the step; a
    reduce adds the payload (which must not overlap what the receiver holds), a copy replaces it.
    """
    names = topology.ranks
    state = {(s, c): frozenset([s]) for s in names for c in range(len(schedule.chunks))}
    out = []
    for step in range(schedule.num_steps):
        moves = [t for t in schedule.transfers if t.step == step]
        payload = [state[(names[t.src], t.chunk)] for t in moves]
        for t, p in zip(moves, payload):
            key = (names[t.dst], t.chunk)
            if t.reduce:
                assert not state[key] & p, f"step {step}: {key} would count {sorted(state[key] & p)} twice"
                state[key] = state[key] | p
            else:
                state[key] = p
        out.append(dict(state))
    return out


# ---- Fig. 4 (b)-(e), verbatim from the paper's figure ------------------------------------------------------
FIG4 = {
    "b": "S[0,0]:<0,*,0>([0,*]),<1,0,*>([*,0])S[0,1]:<0,*,1>([0,*]),<1,0,*>([*,1])S[0,2]:<0,*,2>([0,*]),<1,0,*>([*,2])"
         "S[1,0]:<0,*,0>([1,*]),<1,1,*>([*,0])S[1,1]:<0,*,1>([1,*]),<1,1,*>([*,1])S[1,2]:<0,*,2>([1,*]),<1,1,*>([*,2])"
         "S[2,0]:<0,*,0>([2,*]),<1,2,*>([*,0])S[2,1]:<0,*,1>([2,*]),<1,2,*>([*,1])S[2,2]:<0,*,2>([2,*]),<1,2,*>([*,2])",
    "c": "S[0,0]:<0,0,0>([*,*]),<1,0,0>([*,*])S[0,1]:<0,0,1>([*,*]),<1,0,1>([*,*])S[0,2]:<0,0,2>([*,*]),<1,0,2>([*,*])"
         "S[1,0]:<0,1,0>([*,*]),<1,1,0>([*,*])S[1,1]:<0,1,1>([*,*]),<1,1,1>([*,*])S[1,2]:<0,1,2>([*,*]),<1,1,2>([*,*])"
         "S[2,0]:<0,2,0>([*,*]),<1,2,0>([*,*])S[2,1]:<0,2,1>([*,*]),<1,2,1>([*,*])S[2,2]:<0,2,2>([*,*]),<1,2,2>([*,*])",
    "d": "S[0,0]:<0,*,0>([*,*]),<1,0,*>([*,*])S[0,1]:<0,*,1>([*,*]),<1,0,*>([*,*])S[0,2]:<0,*,2>([*,*]),<1,0,*>([*,*])"
         "S[1,0]:<0,*,0>([*,*]),<1,1,*>([*,*])S[1,1]:<0,*,1>([*,*]),<1,1,*>([*,*])S[1,2]:<0,*,2>([*,*]),<1,1,*>([*,*])"
         "S[2,0]:<0,*,0>([*,*]),<1,2,*>([*,*])S[2,1]:<0,*,1>([*,*]),<1,2,*>([*,*])S[2,2]:<0,*,2>([*,*]),<1,2,*>([*,*])",
    "e": "S[0,0]:<0,*,*>([*,*]),<1,*,*>([*,*])S[0,1]:<0,*,*>([*,*]),<1,*,*>([*,*])S[0,2]:<0,*,*>([*,*]),<1,*,*>([*,*])"
         "S[1,0]:<0,*,*>([*,*]),<1,*,*>([*,*])S[1,1]:<0,*,*>([*,*]),<1,*,*>([*,*])S[1,2]:<0,*,*>([*,*]),<1,*,*>([*,*])"
         "S[2,0]:<0,*,*>([*,*]),<1,*,*>([*,*])S[2,1]:<0,*,*>([*,*]),<1,*,*>([*,*])S[2,2]:<0,*,*>([*,*]),<1,*,*>([*,*])",
}
_SERVER = re.compile(r"S\[(\d),(\d)\]:((?:<[^>]*>\(\[[^\]]*\]\),?)+)")
_PIECE = re.compile(r"<(\d),([\d*]),([\d*])>\(\[([\d*]),([\d*])\]\)")


def _matches(pattern: tuple[str, ...], values: tuple[int, ...]) -> bool:
    return all(p == "*" or int(p) == v for p, v in zip(pattern, values))


def parse_fig4(text: str) -> dict[str, list[tuple[int, set[tuple[int, int, int]], frozenset[str]]]]:
    """{server: [(thread, pieces <e, v1, v0> named by the pattern, contributing servers)]} of one panel."""
    out = {}
    ids = [(a, b) for a in range(3) for b in range(3)]
    for m in _SERVER.finditer(text):
        server = f"s{m[1]}{m[2]}"
        entries = []
        for e, p1, p0, c1, c0 in _PIECE.findall(m[3]):
            pieces = {(int(e), v1, v0) for v1, v0 in ids if _matches((p1, p0), (v1, v0))}
            who = frozenset(f"s{a}{b}" for a, b in ids if _matches((c1, c0), (a, b)))
            entries.append((int(e), pieces, who))
        out[server] = entries
    assert len(out) == 9, "the panel lists all nine servers"
    return out


def test_fig4_walkthrough_on_bcube_3_2():
    t = get_topology("bcube:3,2")
    s = synthesize("bml", t)
    assert s.num_steps == 4  # k aggregation + k broadcast steps
    states = replay(s, t)
    n_servers = 9
    for panel, state in zip("bcde", states):
        expected = parse_fig4(FIG4[panel])
        for server, entries in expected.items():
            for thread, pieces, who in entries:
                # The figure's pieces hold exactly the stated partial sums ...
                chunk_ids = {piece_index((v0, v1, e), 3, 2) for e, v1, v0 in pieces}
                for c in chunk_ids:
                    assert state[(server, c)] == who, (panel, server, piece_digits(c, 3, 2))
                # ... and they are all this thread's most-aggregated pieces on the server: nothing else is as far.
                mine = range(thread * n_servers, (thread + 1) * n_servers)
                best = max(len(state[(server, c)]) for c in mine)
                assert best == len(who) and {c for c in mine if len(state[(server, c)]) == best} == chunk_ids, (panel, server)


def test_fig4_per_step_times():
    # §3.2: the four steps take 6, 2, 2 and 6 T_C (T_C = T_F / 18); 16 T_C = 8/9 T_F in total.
    t = get_topology("bcube:3,2")
    s = synthesize("bml", t)
    t_c = 1 / 18
    for step, want in enumerate([6, 2, 2, 6]):
        sub = type(s)(s.algorithm, s.topology, s.ranks, s.chunks, tuple(x for x in s.transfers if x.step == step))
        assert cost(sub, t) == pytest.approx(want * t_c, rel=1e-12), step
    # The k threads never share a link in a step: thread t uses level (t + w) mod k, the other one the other.
    for x in s.transfers:
        thread = x.chunk // 9
        level = int(x.route[1][1])  # "L{l}.sw{j}"
        w = x.step if x.step < 2 else 3 - x.step  # broadcast step w uses level (k - 1 - w + t) mod k
        assert level == (thread + w) % 2
    assert evaluate(s, t, 1e9).cost == pytest.approx(8 / 9, rel=1e-9)


@pytest.mark.parametrize("n, k", [(2, 2), (3, 2), (4, 2), (2, 3), (3, 3), (2, 4)])
def test_general_walkthrough_matches_the_text(n, k):
    """§3.2 in general: after aggregation step w, thread t of server a sums, for every piece that agrees with
    a on levels t..t+w (mod k), the n**(w+1) servers that differ from a only there; a broadcast step copies
    the finished pieces one level further, so after broadcast step w a server holds n**(w+1) of them."""
    t = get_topology(f"bcube:{n},{k}")
    states = replay(synthesize("bml", t), t)
    big_n = n**k
    digits = {name: [(r // n**i) % n for i in range(k)] for r, name in enumerate(t.ranks)}  # d[i] = v_i
    for w in range(k):
        for a in t.ranks:
            for th in range(k):
                levels = {(th + i) % k for i in range(w + 1)}
                for q in range(big_n):
                    g = [(q // n**i) % n for i in range(k)]
                    if all(g[lv] == digits[a][lv] for lv in levels):
                        who = {s for s in t.ranks if all(digits[s][lv] == digits[a][lv] for lv in range(k) if lv not in levels)}
                        assert states[w][(a, th * big_n + q)] == who
        full = frozenset(t.ranks)
        for a in t.ranks:
            done = sum(1 for c in range(k * big_n) if states[k + w][(a, c)] == full)
            assert done == k * n ** (w + 1)


# ---- Algorithm 1's helpers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n, k", [(2, 1), (3, 2), (2, 3), (3, 3)])
def test_calc_gset_is_the_checkdigits_filter(n, k):
    big_n = n**k
    all_pieces = [piece_digits(i, n, k) for i in range(k * big_n)]
    assert [piece_index(g, n, k) for g in all_pieces] == list(range(k * big_n))
    for q in range(big_n):
        s = [(q // n**i) % n for i in range(k)]
        for t in range(k):
            for w in range(k):
                literal = [piece_index(g, n, k) for g in all_pieces if check_digits(g, s, w, t, k)]
                assert calc_gset(s, w, t, n, k) == literal
                assert len(literal) == big_n // n ** (w + 1)  # §3.2: N / n**(w+1) pieces per neighbour


def test_check_digits_example_from_the_text():
    # Thread 0 of [0,0], step 0: "sends <0,*,1>([0,0]) to server [0,1]" -- pieces (v0=1, v1=any, e=0).
    got = {piece_digits(i, 3, 2) for i in calc_gset([1, 0], 0, 0, 3, 2)}  # s = [0,1]: d[0]=1, d[1]=0
    assert got == {(1, v1, 0) for v1 in range(3)}


# ---- closed forms ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, k", [(2, 1), (5, 1), (2, 2), (3, 2), (4, 2), (5, 2), (2, 3), (3, 3), (2, 4)])
def test_bml_cost_is_the_closed_form(n, k):
    t = get_topology(f"bcube:{n},{k}")
    s = synthesize("bml", t)
    r = evaluate(s, t, 1e9)
    assert r.cost == pytest.approx(bml_gst(n, k), rel=1e-9)
    assert len(s.chunks) == k * n**k and [c.root for c in s.chunks] == list(range(n**k)) * k
    # Every NIC is busy all the time in both directions: every server link direction carries the same load.
    loads = s.link_loads(t).directed
    assert loads.min() == pytest.approx(loads.max(), rel=1e-9)
    # And no schedule whose switches only forward does better (the planner's certified bound).
    assert r.lower_bound == pytest.approx(bml_gst(n, k), rel=1e-6)


@pytest.mark.parametrize("n, k", ALL_SMALL_BCUBES)
def test_bml_checks_on_every_bcube_up_to_64_servers(n, k):
    t = get_topology(f"bcube:{n},{k}")
    s = synthesize("bml", t)  # runs Schedule.check
    assert cost(s, t) == pytest.approx(bml_gst(n, k), rel=1e-9)
    assert s.num_steps == 2 * k
    assert len(s.transfers) == 2 * k * n**k * (n**k - 1)  # N - 1 pieces per thread, stage and server


def test_pipeline_splits_pieces_without_changing_the_cost():
    t = get_topology("bcube:3,2")
    s = synthesize("bml", t, PlanOptions(pipeline=3))
    assert len(s.chunks) == 54 and cost(s, t) == pytest.approx(8 / 9, rel=1e-9)
    h = synthesize("hierarchical", get_topology("fattree:4"), PlanOptions(pipeline=2))
    assert len(h.chunks) == 32 and cost(h, get_topology("fattree:4")) == pytest.approx(ps_gst(16), rel=1e-9)


# ---- PS and hierarchical, BCube and Fat-Tree (Fig. 5) ------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ps_on_bcube_k2(n):
    """Flat PS: each of the N(N-1) flows crosses as many level links as the two addresses differ in digits,
    (n-1)/n of the k = 2 digits on average, so the links carry 2 (n-1)/n at best (met with balanced routes).
    Against BML's 2(N-1)/(kN) that is 2n/(n+1) times as long: the seed's "double" is the large-n limit."""
    t = get_topology(f"bcube:{n},2")
    ps = evaluate(synthesize("ps", t), t, 1e9).cost
    assert ps == pytest.approx(2 * (n - 1) / n, rel=1e-9)
    assert ps / bml_gst(n, 2) == pytest.approx(2 * n / (n + 1), rel=1e-9)
    assert 2 * 32 / 33 > 1.93  # BCube(32,2), Fig. 5's 1024 servers: PS takes 1.94x BML's time


@pytest.mark.parametrize("n, k", [(2, 3), (3, 3), (2, 4)])
def test_ps_on_deeper_bcubes_is_at_least_the_flat_bound(n, k):
    t = get_topology(f"bcube:{n},{k}")
    ps = cost(synthesize("ps", t), t)
    assert ps >= 2 * (n - 1) / n - 1e-9  # average load over the k N up-links
    assert ps >= 1.5 * bml_gst(n, k)


@pytest.mark.parametrize("k", [2, 4, 6])
def test_hierarchical_on_fattree_is_the_ps_gst(k):
    # §3.3: grouping by edge switch, aggregation switch and pod "results in the same GST as running PS".
    t = get_topology(f"fattree:{k}")
    s = synthesize("hierarchical", t)
    r = evaluate(s, t, 1e9)
    assert r.cost == pytest.approx(ps_gst(t.world_size), rel=1e-9)
    assert r.link_classes["host"]["max_busy_cost"] == pytest.approx(r.cost, rel=1e-9)
    assert r.link_classes["host"]["mean_utilisation"] == pytest.approx(1.0, rel=1e-9)  # every NIC busy, balanced
    assert r.lower_bound == pytest.approx(r.cost, rel=1e-6)  # and nothing does better on one NIC per server
    assert [c.root for c in s.chunks] == list(range(t.world_size))


@pytest.mark.parametrize("k", [2, 4, 6])
def test_ps_on_fattree_is_two_n_minus_one_over_n(k):
    # D-mod-k routing (plan/routing.py) spreads PS's all-to-all flows over the equal-cost paths, so the
    # non-blocking Fat-Tree delivers the seed's 2(N-1)/N, the same as hierarchical (seed §3.3).
    t = get_topology(f"fattree:{k}")
    n = t.world_size
    ps = evaluate(synthesize("ps", t), t, 1e9).cost
    assert ps == pytest.approx(ps_gst(n), rel=1e-9)
    assert ps == pytest.approx(evaluate(synthesize("hierarchical", t), t, 1e9).cost, rel=1e-9)


def test_ps_on_fattree_host_links_carry_the_ps_gst():
    # What the seed's PS analysis counts -- each NIC pushes and pulls (N-1)/N -- holds on the host links.
    t = get_topology("fattree:4")
    r = evaluate(synthesize("ps", t), t, 1e9)
    assert r.link_classes["host"]["max_busy_cost"] == pytest.approx(ps_gst(16), rel=1e-9)


@pytest.mark.parametrize("n, k", [(3, 1), (3, 2), (2, 3), (4, 2)])
def test_hierarchical_on_bcube_uses_one_level_at_a_time(n, k):
    # One thread walks levels 0..k-1: the level-0 links carry 2 (n-1)/n (PS's share); BML's rotation of the
    # levels over k threads is what brings it down to 2 (N-1)/(kN). With k = 1 the two are the same schedule.
    t = get_topology(f"bcube:{n},{k}")
    h = evaluate(synthesize("hierarchical", t), t, 1e9)
    assert h.cost == pytest.approx(2 * (n - 1) / n, rel=1e-9)
    assert h.link_classes["level0"]["max_busy_cost"] == pytest.approx(h.cost, rel=1e-9)
    if k == 1:
        assert h.cost == pytest.approx(bml_gst(n, 1), rel=1e-9)


# ---- applicability -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["fattree:4", "switch:9", "p3.16xlarge", "bcube:3,2[0,1,2,3]"])
def test_bml_only_on_whole_bcubes(spec):
    with pytest.raises(PlanError, match="does not apply.*(not a BCube|no switch hierarchy)"):
        synthesize("bml", get_topology(spec))


@pytest.mark.parametrize("spec", ["switch:9", "ring:4", "fattree:4[0,1,2]"])
def test_hierarchical_only_where_the_links_form_a_hierarchy(spec):
    with pytest.raises(PlanError, match="does not apply.*no switch hierarchy.*one of ring, .*lp"):
        synthesize("hierarchical", get_topology(spec))


def test_auto_considers_bml_and_hierarchical_on_bcube():
    t = get_topology("bcube:2,2")
    auto = synthesize("auto", t).meta["auto"]
    assert {"bml", "hierarchical"} <= set(auto["algorithms"])
    times = auto["predicted_time_s"]  # "algorithm/pipeline" -> seconds under the runtime's cost model
    # BML is bandwidth-optimal here (lp ties it): under the runtime's model only message costs separate it
    # from the fastest (a ring whose ranks receive one message a step against BML's two), and auto's
    # pick is the fastest candidate.
    best = min(times.values())
    assert min(v for k, v in times.items() if k.startswith("bml/")) <= best * 1.005
    assert times[f"{auto['chosen']}/{auto['pipeline']}"] == best
    assert "bml" not in synthesize("auto", get_topology("fattree:2")).meta["auto"]["algorithms"]

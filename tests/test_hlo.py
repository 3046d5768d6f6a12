from jdp import _hlo

MODULE = """HloModule jit_step, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%sync_branch (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  ROOT %ar.2 = f32[1024]{0} all-reduce(f32[1024]{0} %p), channel_id=2, replica_groups=[2,4]<=[8], to_apply=%add
}

%skip_branch (p: f32[1024]) -> f32[1024] {
  ROOT %p = f32[1024]{0} parameter(0)
}

ENTRY %main (x: f32[1024], i: s32[]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %i = s32[] parameter(1)
  %ar.1 = (f32[512,2]{1,0}, bf16[10]{0}) all-reduce(f32[512,2]{1,0} %x, bf16[10]{0} %x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %rs = f32[128]{0} reduce-scatter(f32[1024]{0} %x), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %ag = f32[1024]{0} all-gather(f32[128]{0} %rs), channel_id=4, replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %c = f32[1024]{0} conditional(s32[] %i, f32[1024]{0} %ag, f32[1024]{0} %ag), branch_computations={%skip_branch, %sync_branch}
}
"""


def test_parses_kinds_bytes_groups_order_and_conditionals():
    ops = _hlo.parse_collectives(MODULE)
    assert [c.kind for c in ops] == [
        "all-reduce",
        "reduce-scatter",
        "all-gather",
        "all-reduce",
    ]
    ar, rs, ag, cond = ops
    assert ar.dtype == "f32,bf16" and ar.bytes == 512 * 2 * 4 + 10 * 2
    assert ar.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert rs.result_bytes == 512 and rs.bytes == 4096  # the full input buffer
    assert ag.bytes == 4096 and ag.replica_groups == (tuple(range(8)),)
    assert cond.in_conditional and not any(c.in_conditional for c in ops[:3])
    assert cond.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert [c.order for c in ops] == [0, 1, 2, 3]


def test_iota_groups_with_transpose():
    text = (
        "ENTRY %m {\n  %a = f32[4]{0} all-reduce(f32[4]{0} %x), "
        "replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add\n}\n"
    )
    (op,) = _hlo.parse_collectives(text)
    assert op.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_no_entry_means_no_collectives():
    assert _hlo.parse_collectives("not hlo") == []

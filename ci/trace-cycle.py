#!/usr/bin/env python3
"""Splits the cycle of `transfer --tasks per-round` (IPC) into its steps, from a merged trace.

Usage: ci/trace-cycle.py DIR/trace-merged.json  (after `cargo xtask trace-merge DIR` of a run
with FERRY_TRACE=DIR; see the benchmark work log, session 22, calls H-J, in git history:
`git show b47892c:docs/benchmarks.md`). Rank 0 stamps, rank 1 pulls (`ipc` spans) and sinks. Same-rank host/device gaps rely on the trace's device-clock
anchor (device/manager/timeline.rs); cross-rank gaps also on the ranks' clock sync.
"""
import json,statistics as st,sys,bisect
ev=json.load(open(sys.argv[1]))
ev = ev['traceEvents'] if isinstance(ev,dict) else ev
tn={}
for e in ev:
    if e.get('ph')=='M' and e.get('name')=='thread_name': tn[(e['pid'],e['tid'])]=e['args']['name']
def spans(pid,name):
    out={};stack=[]
    for e in sorted([e for e in ev if e.get('pid')==pid and tn.get((pid,e.get('tid')))=='ferry-gpu' and e.get('ph') in ('B','E')], key=lambda e:e['ts']):
        if e['ph']=='B': stack.append(e)
        else:
            b=stack.pop()
            if b['name']==name: out[int(b.get('args',{}).get('seq','-1').strip('"'))]=(b['ts'],e['ts'])
    return out
ex0=spans(0,'gpu.exec'); fin0=spans(0,'gpu.finalize'); ex1=spans(1,'gpu.exec'); fin1=spans(1,'gpu.finalize')
dev=lambda n:sorted([e for e in ev if e.get('ph')=='X' and e['name']==n],key=lambda e:e['ts'])
stamps,ipcs,sinks=dev('stamp'),dev('ipc'),dev('sink')
ipc_start=[p['ts'] for p in ipcs]
def q(x):
    x=sorted(x); n=len(x); return f"median {st.median(x):7.1f}  p10 {x[n//10]:7.1f}  p90 {x[9*n//10]:7.1f}  n={n}"
# rank 0 only
S=[s for s in stamps if s['args']['seq'] in ex0][4:]
print("producer: launch call (gpu.exec)            ", q([ex0[s['args']['seq']][1]-ex0[s['args']['seq']][0] for s in S]))
print("producer: launch call begin -> stamp starts  ", q([s['ts']-ex0[s['args']['seq']][0] for s in S]))
print("stamp kernel                                 ", q([s['dur'] for s in S]))
print("producer: stamp end -> its finalize begins   ", q([fin0[s['args']['seq']][0]-(s['ts']+s['dur']) for s in S if s['args']['seq'] in fin0]))
# rank 1 only
K=[k for k in sinks if k['args']['seq'] in ex1][4:]
def pull_before(t):
    i=bisect.bisect_right([p['ts']+p['dur'] for p in ipcs], t)-1
    return ipcs[i] if i>=0 else None
print("consumer: sink launch call                   ", q([ex1[k['args']['seq']][1]-ex1[k['args']['seq']][0] for k in K]))
print("consumer: sink launch begin vs its pull start", q([ex1[k['args']['seq']][0]-pull_before(k['ts'])['ts'] for k in K]))
print("consumer: pull end -> sink starts            ", q([k['ts']-(pull_before(k['ts'])['ts']+pull_before(k['ts'])['dur']) for k in K]))
print("consumer: pull end -> sink finalize begins   ", q([fin1[k['args']['seq']][0]-(pull_before(k['ts'])['ts']+pull_before(k['ts'])['dur']) for k in K if k['args']['seq'] in fin1]))
print("pull span                                    ", q([p['dur'] for p in ipcs[4:]]))
# cross rank: stamp end -> next pull start
fw=[]
for s in S:
    end=s['ts']+s['dur']; i=bisect.bisect_left(ipc_start, s['ts'])
    if i<len(ipcs): fw.append(ipcs[i]['ts']-end)
print("stamp end -> next pull span starts (x-rank)  ", q(fw))
cyc=[]
for a,b in zip(S,S[2:]): cyc.append(b['ts']-a['ts'])
print("half cycle                                   ", q(cyc))
# The devices' clock anchors renewed during the run (device/manager/timeline.rs, `gpu.anchor`):
# how far each renewed anchor had drifted from the one before it.
for pid in sorted({e.get('pid') for e in ev if 'shift_us' in e.get('args', {})}):
    a=[e['args'] for e in ev if e.get('pid')==pid and 'shift_us' in e.get('args', {})]
    for d in sorted({x['device'] for x in a}):
        sh=[float(x['shift_us']) for x in a if x['device']==d]; w=[float(x['width_us']) for x in a if x['device']==d]
        print(f"rank {pid} device {d}: {len(sh)} anchors, shift µs first {sh[0]:.1f} then {q(sh[1:]) if len(sh)>2 else '-'}; bracket median {st.median(w):.1f}")

#!/usr/bin/env python3
"""Import cycles between lens-userspace's top-level modules (a folder or a file under
src/), from the `crate::` paths in their code (comments and tests aside). Prints them
and exits 1 if there is any. Usage: scripts/module-cycles.py (from the repository root)."""
import re,glob,itertools
root='lens-userspace/src'
deps={}
for path in glob.glob(root+'/**/*.rs',recursive=True):
    rel=path[len(root)+1:]
    top=rel.split('/')[0].replace('.rs','')
    if top in ('lib','main') or rel.endswith('tests.rs'): continue
    s=open(path).read()
    i=s.find('#[cfg(test)]')
    if i>=0: s=s[:i]
    s='\n'.join(l for l in s.split('\n') if not l.strip().startswith('//'))
    for m in re.finditer(r'crate::([a-z_]+)',s):
        if m.group(1)!=top: deps.setdefault(top,set()).add(m.group(1))
    for m in re.finditer(r'use crate::\{(.*?)\};',s,re.S):
        depth=0;tok='';names=[]
        for ch in m.group(1)+',':
            if ch=='{': depth+=1
            elif ch=='}': depth-=1
            if depth==0 and ch==',':
                names.append(tok.strip().split('::')[0].strip()); tok=''
            else: tok+=ch
        for n in names:
            if n and n!=top and n!='self': deps.setdefault(top,set()).add(n)
# longer cycles via DFS
import sys
sys.setrecursionlimit(10000)
cyc=set()
def dfs(n,stack):
    for d in deps.get(n,()):
        if d in stack:
            c=stack[stack.index(d):]
            k=min(range(len(c)),key=lambda i:c[i]); cyc.add(tuple(c[k:]+c[:k]))
        elif len(stack)<6: dfs(d,stack+[d])
for n in deps: dfs(n,[n])
for c in sorted(cyc, key=len):
    print(" -> ".join(c + (c[0],)))
print(f"{len(cyc)} import cycles between top-level modules")
raise SystemExit(1 if cyc else 0)

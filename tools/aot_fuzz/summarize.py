# tools/aot_fuzz/summarize.py -- groups fuzz.py's bad_*.txt by the first sanitizer line.
import re, collections, sys
txt = open(sys.argv[1]).read().split('\n')
groups = collections.defaultdict(list)
cur = None; rc = None
for l in txt:
    if l.startswith(('set','del')): cur = l; rc = None; seen = False
    elif l.strip().startswith('rc=') and cur:
        rc = l.strip()[:60]
        if 'TIMEOUT' in l: groups['TIMEOUT'].append(cur)
    elif l.strip() and cur:
        if ('SUMMARY' in l or 'runtime error' in l) and not seen:
            seen = True
            key = re.sub(r'0x[0-9a-f]+|==\d+==|\(pc.*|\d{5,}', '', l.strip())[:150]
            groups[key].append(cur)
for k, v in groups.items():
    print(len(v), k); [print('    ', x) for x in v[:4]]

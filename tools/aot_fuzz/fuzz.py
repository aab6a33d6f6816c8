# tools/aot_fuzz/fuzz.py -- mutates one field of an exported digits_mlp / digits_mlp_train
# artifact's manifest (NAME.json) or plan (NAME.plan, its checksum then fixed in the manifest) at a
# time and runs ./driver on each copy, recording crashes and sanitizer reports in bad_*.txt and
# mutations opened and run without complaint in ok_*.txt (in the current directory).
# Usage (an artifact exported by an ASan build: build-asan/digits_mlp --steps 20 --export ART):
#   cc -O2 xxh.c -o xxh -lxxhash
#   cc -g -fsanitize=address,undefined -IART driver.c -o driver -LART -Wl,-rpath,ART \
#      -ldigits_mlp -ldigits_mlp_train -fsanitize=address,undefined
#   python3 fuzz.py ART fn|train json|plan [LIMIT]; python3 summarize.py bad_fn_plan.txt
import json, os, sys, subprocess, shutil, random, copy
here = os.path.dirname(os.path.abspath(__file__))
base = sys.argv[1]; which = sys.argv[2]; target = sys.argv[3]  # which: fn|train ; target: json|plan
limit = int(sys.argv[4]) if len(sys.argv) > 4 else 10**9
name = 'digits_mlp' if which == 'fn' else 'digits_mlp_train'
src = json.load(open(f'{base}/{name}.{ "json" if target=="json" else "plan"}'))
paths = []
def walk(v, p):
    paths.append(p)
    if isinstance(v, dict):
        for k in v: walk(v[k], p + [k])
    elif isinstance(v, list):
        for i, e in enumerate(v): walk(e, p + [i])
walk(src, [])
def get(v, p):
    for k in p: v = v[k]
    return v
def muts(v):
    out = []
    if isinstance(v, bool): out += [not v, 0, "x", None]
    elif isinstance(v, int): out += [-1, 0, 1, v + 1, v - 1, 2**31, 2**62, 2**63 - 1, -2**63, 10**30, "7", None, 1.5, [], {}]
    elif isinstance(v, str): out += ["", "x", 5, None, "f64", "i64", "bool", "bf16", "../x", "matmul", "add", "constant", "0"]
    elif isinstance(v, list): out += [[], v[:-1] if v else [1], (v + v[-1:]) if v else [0], {}, 3, None]
    elif isinstance(v, dict): out += [{}, [], 3]
    return out
cases = []
for p in paths:
    v = get(src, p)
    for m in muts(v): cases.append(('set', p, m))
    if p and isinstance(get(src, p[:-1]), dict): cases.append(('del', p, None))
random.seed(1)
if len(cases) > limit: cases = random.sample(cases, limit)
work = os.path.abspath(f'w_{which}_{target}')
shutil.rmtree(work, ignore_errors=True); os.makedirs(work)
for f in os.listdir(base):
    os.link(f'{base}/{f}', f'{work}/{f}') if not f.startswith(name + '.') else shutil.copy(f'{base}/{f}', f'{work}/{f}')
man0 = json.load(open(f'{base}/{name}.json'))
env = dict(os.environ, ASAN_OPTIONS='detect_leaks=0', UBSAN_OPTIONS='print_stacktrace=1:halt_on_error=1')
bad = open(f'bad_{which}_{target}.txt', 'w'); accepted = open(f'ok_{which}_{target}.txt', 'w')
for i, (kind, p, m) in enumerate(cases):
    doc = copy.deepcopy(src)
    if kind == 'del':
        del get(doc, p[:-1])[p[-1]]
    elif p == []:
        doc = m
    else:
        get(doc, p[:-1])[p[-1]] = m
    text = json.dumps(doc, separators=(',', ':'))
    fn = f'{work}/{name}.{"json" if target=="json" else "plan"}'
    open(fn, 'w').write(text)
    if target == 'plan':
        n, h = subprocess.run([os.path.join(here, 'xxh'), fn], capture_output=True, text=True).stdout.split()
        man = copy.deepcopy(man0); man['files'][f'{name}.plan'] = {'bytes': int(n), 'xxh3_64': h, 'verify': True}
        open(f'{work}/{name}.json', 'w').write(json.dumps(man, separators=(',', ':')))
    try:
        r = subprocess.run([os.path.join(here, 'driver'), work, which], capture_output=True, text=True, timeout=20, env=env)
        rc, so, se = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired:
        rc, so, se = 'TIMEOUT', '', ''
    desc = f'{kind} {p} = {json.dumps(m)[:60]}'
    if rc != 0 or 'ERROR: AddressSanitizer' in se or 'runtime error' in se:
        first = [l for l in se.splitlines() if 'ERROR' in l or 'runtime error' in l or 'SUMMARY' in l][:3]
        bad.write(f'{desc}\n  rc={rc} {so.strip()[:300]}\n  ' + '\n  '.join(first) + '\n'); bad.flush()
    elif all(l.split(' ')[1] == '0' for l in so.strip().splitlines() if l):
        accepted.write(desc + '\n'); accepted.flush()
    if i % 200 == 0: print(i, len(cases), flush=True)
print('done', len(cases))

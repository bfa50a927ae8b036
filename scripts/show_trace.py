"""Prints profile_graph_step.py --trace output compactly: python scripts/show_trace.py FILE."""
import json, sys
for l in open(sys.argv[1]):
    d = json.loads(l)
    print(d['mode'], 'replay', d['replay_ms'])
    for v in d['sweep'] + [{'variant': 'final', 'replay_ms': d['replay_ms'], 'trace': d.get('trace', [])}]:
        print(' ', v['variant'], v['replay_ms'])
        for r in v.get('trace', []):
            print('    %-12s start %6.2f..%6.2f waited %6.2f..%6.2f worked %6.2f/%6.2f/%6.2f end %6.2f' % (
                r['kernel'], r['start'][0], r['start'][4], r['waited'][0], r['waited'][4],
                r['worked'][0], r['worked'][2], r['worked'][4], r['end'][4]))

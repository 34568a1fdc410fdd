#!/usr/bin/env bash
# Device-machine driver (copied into the snapshot by bench/device/prep.sh). Usage:
#   bash bench/device/run.sh MODE [args]   with KILN_COMMIT set by the caller
# MODE: tests (TESTS, TESTS_T) | shape SHAPE [extra gpu_shape_decode args] | tune SHAPE KERNELS |
#       bench SHAPE [WORKLOADS] (FORMAT, BENCH_ARGS e.g. "--peers hf-eager hf-compile", BENCH_T) | cmd TAG "command"
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/kiln
export PYTHONPATH=/tmp/pkg:$PWD:/tmp/site
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kc}
[ -f /tmp/deps_ok ] || python3 -c "import jsonschema, transformers, torch, tornado, llguidance, gguf, kiln; print('deps ok', torch.cuda.get_device_name(0))" && touch /tmp/deps_ok || exit 1
mkdir -p $OUT/t
mode=$1; shift; tag=${1:-x}
case $mode in
tests)
  timeout ${TESTS_T:-540} python3 -m pytest -q -rfE -p no:cacheprovider ${TESTS} 2>&1 | tee $OUT/t/tests.log | tail -60 ;;
shape)
  s=$1; shift
  timeout ${SHAPE_T:-540} python3 bench/gpu_shape_decode.py --shape $s --max-num-seqs 16 --json $OUT/t/${s}_shape.json "$@" 2>&1 | tee $OUT/t/${s}_shape.log | tail -80 ;;
tune)
  s=$1; k=$2; mkdir -p /tmp/cfg_$s
  python3 -c "import sys,json; sys.path.insert(0,'bench'); from make_random_model import hf_config; open('/tmp/cfg_$s/config.json','w').write(json.dumps(hf_config('$s')))"
  timeout ${TUNE_T:-540} python3 build.py tune --model /tmp/cfg_$s --target sm_90 --kernels $k --max-num-seqs 16 2>&1 | tee $OUT/t/tune_${s}.log | tail -60
  cp schedules/sm_90/*.yaml $OUT/t/ ;;
cmd)
  shift
  timeout ${CMD_T:-540} bash -c "$*" 2>&1 | tee $OUT/t/cmd_$tag.log | tail -60 ;;
bench)
  # FORMAT (bf16 default | fp8 | nvfp4 | q4k): the random checkpoint's format; records are named
  # <gpu>_<shape>_[<format>_]<workload>_<commit>.json as issues 38 and 40 ask, <gpu> from the card
  s=$1; w=${2:-decode}; f=${FORMAT:-bf16}; m=/tmp/m_${s}_$f
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9][0-9]*' | head -1 | tr H h); gpu=${gpu:-gpu}
  tagf=$([ "$f" = bf16 ] && [ -z "$FORMAT" ] && echo "" || echo "${f}_")
  pure=$([ "$f" = q4k ] && echo --pure)  # issue 40: every linear Q4_K (llama-quantize --pure)
  [ -d $m ] || python3 bench/make_random_model.py --shape $s --format $f $pure --out $m --spill-dir /dev/shm/m_${s}_$f --keep-gb 40 2>&1 | tail -3
  model=$m; [ "$f" = q4k ] && model=$m/$s-Q4_K.gguf
  sn=${s/llama-3.1-8b/llama8b}  # issue 40's <shape> name for the 8B records
  for x in ${w//,/ }; do
    timeout ${BENCH_T:-400} python3 build.py bench --workload $x --model $model --target sm_90 --max-num-seqs 16 $BENCH_ARGS --json $OUT/t/${gpu}_${sn}_${tagf}${x}_${KILN_COMMIT}.json 2>&1 | tail -30
  done ;;
esac
cd $OUT && tar czf t_${mode}_${tag}_$(date +%H%M%S).tgz t && rm -rf t

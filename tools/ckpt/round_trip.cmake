# The 4 -> 3 round trip of docs/checkpoints.md, from the command line: train 5 steps on
# 4 ranks and save; list and verify; consolidate to safetensors and back as a checkpoint
# for 3 ranks; resume it on 3 ranks, and load the 4-rank checkpoint on 3 HybridShard
# ranks directly. Both continuations must match 10 uninterrupted steps on 4 ranks.
#   cmake -DCKPT=shardlib-ckpt -DDEMO=ckpt-demo -DWORK=dir -P round_trip.cmake
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REPLACE ";" " " shown "${ARGV}")
  message("$ ${shown}\n${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "exit status ${rc}")
  endif()
endfunction()

file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
run(${DEMO} --world 4 --steps 10 --out ${WORK}/uninterrupted.txt)
run(${DEMO} --world 4 --steps 5 --save ${WORK}/four --chunk-bytes 1024)
run(${CKPT} list ${WORK}/four)
run(${CKPT} verify ${WORK}/four)
run(${CKPT} to-safetensors ${WORK}/four ${WORK}/model.safetensors --optimizer)
run(${CKPT} from-safetensors ${WORK}/model.safetensors ${WORK}/three --world 3 --strategy FullShard --chunk-bytes 1024)
run(${CKPT} verify ${WORK}/three)
run(${DEMO} --world 3 --steps 5 --resume ${WORK}/three --out ${WORK}/via-safetensors.txt)
run(${DEMO} compare ${WORK}/uninterrupted.txt ${WORK}/via-safetensors.txt)
run(${DEMO} --world 3 --strategy HybridShard --group-size 3 --steps 5 --resume ${WORK}/four --out ${WORK}/direct.txt)
run(${DEMO} compare ${WORK}/uninterrupted.txt ${WORK}/direct.txt)

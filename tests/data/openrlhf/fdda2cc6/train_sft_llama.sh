# Copied as published from github.com/OpenRLHF/OpenRLHF (then OpenLLaMA2), commit fdda2cc6f988bff4d4beef75f843c66fd00b068f,
# path examples/scripts/train_sft_llama.sh: the commands that write and load ./ckpt/7b_llama/sft_model.pt and rm_model.pt.
# Read by tests/test_openrlhf_dialect.py; nothing below this header is changed.
set -x
export PATH=$HOME/.local/bin/:$PATH

deepspeed ../train_sft.py \
    --max_len 2048 \
    --dataset 'Open-Orca/OpenOrca' \
    --dataset_probs '1.0' \
    --train_batch_size 128 \
    --micro_train_batch_size 1 \
    --max_samples 500000 \
    --pretrain "meta-llama/Llama-2-7b-hf" \
    --save_path "./ckpt/7b_llama" \
    --zero_stage 2 \
    --max_epochs 1 \
    --bf16 \
    --learning_rate 5e-6 \
    --gradient_checkpointing

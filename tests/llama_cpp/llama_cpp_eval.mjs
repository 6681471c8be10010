// Runs a GGUF model in llama.cpp (npm node-llama-cpp, its prebuilt CPU binary; never a download
// or a build) and prints, as JSON on stdout, how llama.cpp tokenizes a prompt and, for n greedy
// steps after it, the token chosen and the next-token probabilities of every vocabulary entry.
//   node llama_cpp_eval.mjs NPM_DIR MODEL.gguf PROMPT_FILE N
// The KV cache is float32 (llama.cpp's default is float16, which would round keys and values).
import path from "node:path";
import fs from "node:fs";
import { pathToFileURL } from "node:url";

const [npmDir, modelPath, promptFile, nText] = process.argv.slice(2);
const entry = path.join(npmDir, "node_modules", "node-llama-cpp", "dist", "index.js");
const { getLlama, LlamaLogLevel } = await import(pathToFileURL(entry).href);

const llama = await getLlama({
  gpu: false, build: "never", usePrebuiltBinaries: true, skipDownload: true, progressLogs: false,
  logLevel: LlamaLogLevel.error, maxThreads: 1,
});
const model = await llama.loadModel({ modelPath, gpuLayers: 0 });
const prompt = fs.readFileSync(promptFile, "utf8");
const n = Number(nText);
const tokens = Array.from(model.tokenize(prompt));
const context = await model.createContext({
  contextSize: model.trainContextSize, sequences: 1, flashAttention: false, threads: 1,
  experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32",
});
const steps = [];
const generator = context.getSequence().evaluateWithMetadata(tokens, { probabilities: true }, { temperature: 0 });
for await (const out of generator) {
  const probs = new Array(out.probabilities.size).fill(0);  // every vocabulary entry is listed
  for (const [token, p] of out.probabilities) probs[token] = p;
  steps.push({ token: out.token, probs });
  if (steps.length >= n) break;
}
const pieces = tokens.map((t) => model.detokenize([t]));
process.stdout.write(JSON.stringify({ tokens, pieces, steps }) + "\n");
await context.dispose();
await model.dispose();
await llama.dispose();

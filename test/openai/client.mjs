// Drives a mooncake-go server with the official `openai` npm client:
// completions (whole and streamed), chat (whole and streamed), models, and
// the errors the client must see. Run by openai_test.go:
//
//   OPENAI_NPM_DIR=.cache/npm-openai BASE_URL=http://127.0.0.1:PORT/v1 MODEL=name \
//     [FAIL_BASE_URL=...] [EXPECT_TEXT=...] node test/openai/client.mjs
//
// Generation requests carry SGLang's ignore_eos, so random-weight models
// produce text too.
// Exits non-zero on the first failed check; prints one JSON line of results.
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import path from 'node:path';

const npmDir = process.env.OPENAI_NPM_DIR;
const require = createRequire(path.join(path.resolve(npmDir), 'package.json'));
const OpenAI = require('openai');

const model = process.env.MODEL;
const client = new OpenAI({ apiKey: 'none', baseURL: process.env.BASE_URL, maxRetries: 0, timeout: 60_000 });
const expect = process.env.EXPECT_TEXT; // when set, the greedy completion must start with it
const results = {};

// models
const models = [];
for await (const m of client.models.list()) models.push(m.id);
assert.deepEqual(models, [model]);

// completion
const c = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 8, temperature: 0, ignore_eos: true });
assert.equal(c.object, 'text_completion');
assert.equal(c.choices.length, 1);
assert.equal(typeof c.choices[0].text, 'string');
assert.ok(c.choices[0].text.length > 0, 'empty completion');
assert.ok(['stop', 'length'].includes(c.choices[0].finish_reason), c.choices[0].finish_reason);
assert.ok(c.usage.prompt_tokens > 0 && c.usage.completion_tokens > 0);
assert.equal(c.usage.total_tokens, c.usage.prompt_tokens + c.usage.completion_tokens);
if (expect) assert.ok(c.choices[0].text.startsWith(expect), `completion ${JSON.stringify(c.choices[0].text)}`);
results.completion = c.choices[0].text;

// streamed completion: same text as the whole one (greedy), usage at the end
const s = await client.completions.create({
  model, prompt: 'Once upon a time', max_tokens: 8, temperature: 0, ignore_eos: true, stream: true,
  stream_options: { include_usage: true },
});
let text = '', finish = null, usage = null, chunks = 0;
for await (const chunk of s) {
  chunks++;
  if (chunk.usage) usage = chunk.usage;
  for (const ch of chunk.choices) {
    text += ch.text;
    if (ch.finish_reason) finish = ch.finish_reason;
  }
}
assert.equal(text, c.choices[0].text);
assert.equal(finish, c.choices[0].finish_reason);
assert.ok(chunks > 1, `only ${chunks} chunks`);
assert.deepEqual(usage, c.usage);
results.streamChunks = chunks;

// chat
const chat = await client.chat.completions.create({
  model, messages: [{ role: 'system', content: 'You are brief.' }, { role: 'user', content: 'Hello!' }],
  max_tokens: 8, temperature: 0, ignore_eos: true,
});
assert.equal(chat.object, 'chat.completion');
assert.equal(chat.choices[0].message.role, 'assistant');
assert.equal(typeof chat.choices[0].message.content, 'string');
assert.ok(chat.choices[0].message.content.length > 0, 'empty chat reply');
assert.ok(chat.usage.completion_tokens > 0);
results.chat = chat.choices[0].message.content;

// streamed chat
const cs = await client.chat.completions.create({
  model, messages: [{ role: 'system', content: 'You are brief.' }, { role: 'user', content: 'Hello!' }],
  max_tokens: 8, temperature: 0, ignore_eos: true, stream: true,
});
let reply = '', role = null, chatFinish = null;
for await (const chunk of cs) {
  const d = chunk.choices[0]?.delta;
  if (d?.role) role = d.role;
  if (d?.content) reply += d.content;
  if (chunk.choices[0]?.finish_reason) chatFinish = chunk.choices[0].finish_reason;
}
assert.equal(role, 'assistant');
assert.equal(reply, chat.choices[0].message.content);
assert.equal(chatFinish, chat.choices[0].finish_reason);

// errors reach the client as typed errors
await assert.rejects(
  client.completions.create({ model: 'no-such-model', prompt: 'x' }),
  (e) => e instanceof OpenAI.NotFoundError && e.status === 404 && /no-such-model/.test(e.message),
);
await assert.rejects(
  client.completions.create({ model, prompt: 'x', n: 129 }),
  (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === 'n',
);

// n > 1: choices indexed 0..n-1; a list of prompts: a choice per prompt (NO_N skips it:
// through the LB, n > 1 waits for the LB to send it whole to one pair)
if (!process.env.NO_N) {
  const n2 = await client.completions.create({ model, prompt: 'Once upon a time', max_tokens: 4, n: 2 });
  assert.deepEqual(n2.choices.map((ch) => ch.index), [0, 1]);
  const batch = await client.completions.create({ model, prompt: ['Once upon a time', 'The cat'], max_tokens: 4, temperature: 0 });
  assert.equal(batch.choices.length, 2);
  const chat2 = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'hi' }], max_tokens: 4, n: 2 });
  assert.deepEqual(chat2.choices.map((ch) => ch.index), [0, 1]);
  results.nChoices = true;
}
await assert.rejects(
  client.chat.completions.create({ model, messages: [] }),
  (e) => e instanceof OpenAI.BadRequestError && e.status === 400,
);

// what the server does not implement is refused, naming the field
for (const [extra, param] of [
  [{ response_format: { type: 'json_object' } }, 'response_format'],
  [{ tools: [{ type: 'function', function: { name: 'f', parameters: {} } }] }, 'tools'],
  [{ max_tokens: '8' }, 'max_tokens'],
]) {
  await assert.rejects(
    client.chat.completions.create({ model, messages: [{ role: 'user', content: 'x' }], ...extra }),
    (e) => e instanceof OpenAI.BadRequestError && e.param === param,
  );
}
results.refusedFields = true;

// a stream that fails after it started ends in an error, not in silence
if (process.env.FAIL_BASE_URL) {
  const failing = new OpenAI({ apiKey: 'none', baseURL: process.env.FAIL_BASE_URL, maxRetries: 0 });
  const fs = await failing.completions.create({ model, prompt: 'x', stream: true });
  let got = '';
  await assert.rejects(
    (async () => { for await (const chunk of fs) got += chunk.choices[0]?.text ?? ''; })(),
    (e) => e instanceof OpenAI.APIError && /device lost/.test(e.message),
  );
  assert.equal(got, 'ab');
  results.failedStream = true;
}

console.log(JSON.stringify(results));

// transformers.js on one model folder as it is, from the local path (no hub).
//
//   node run.mjs REQUEST.json      (from a copy beside the node_modules it was installed into: harness.py)
//
// REQUEST.json (written by tests/support/transformers_js/harness.py):
//   {"folder": "/abs/path", "dtype": "fp32", "max_new_tokens": 12, "runs": [RUN, ...]}
//   RUN, given:   {"inputs": {name: {"dtype": "float32" | "int64" | "bool", "dims": [...],
//                                    "data": base64 of the little-endian values}}}
//                 every input generate() takes: input_ids, attention_mask, pixel_values, and the
//                 family's own (image_grid_thw, pixel_attention_mask)
//   RUN, as a user would: {"image": "/abs/path.png", "prompt": "..."}  (the folder's processor and chat template)
// Prints one JSON line: {"answers": [{"tokens": [new token ids], "input_ids": [the prompt's ids]}, ...]}.
// Greedy, at most max_new_tokens; the folder's generation_config.json's end-of-text tokens stop it
// (the stop token is among the tokens, as transformers.js gives it).
import path from 'node:path';
import { readFileSync } from 'node:fs';
import { AutoModelForImageTextToText, AutoProcessor, RawImage, Tensor, env } from '@huggingface/transformers';

env.allowRemoteModels = false; // a folder that needs the hub is not in the published layout
env.allowLocalModels = true;

const request = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const folder = path.resolve(request.folder);
env.localModelPath = path.dirname(folder) + path.sep;
const modelId = path.basename(folder);

const ARRAYS = { float32: Float32Array, int64: BigInt64Array, bool: Uint8Array };

function tensorOf({ dtype, dims, data }) {
    const bytes = Buffer.from(data, 'base64');
    // copied: a Buffer's offset into its pool need not be aligned for the typed array
    const values = new ARRAYS[dtype](bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength));
    return new Tensor(dtype, values, dims);
}

let processor = null;

async function asUser({ image, prompt }) {
    processor ??= await AutoProcessor.from_pretrained(modelId);
    const messages = [{ role: 'user', content: [{ type: 'image' }, { type: 'text', text: prompt }] }];
    const text = processor.apply_chat_template(messages, { add_generation_prompt: true });
    const picture = await RawImage.read(image);
    // the template writes the special tokens itself: tokenized without adding any, as transformers'
    // apply_chat_template does (else Gemma 3's prompt starts with two <bos>)
    const options = { add_special_tokens: false };
    // LlavaProcessor alone takes the images first
    return processor.constructor.name === 'LlavaProcessor'
        ? await processor(picture, text, options)
        : await processor(text, picture, options);
}

function given({ inputs }) {
    return Object.fromEntries(Object.entries(inputs).map(([name, t]) => [name, tensorOf(t)]));
}

const model = await AutoModelForImageTextToText.from_pretrained(modelId, {
    dtype: request.dtype,
    device: 'cpu',
    session_options: { intraOpNumThreads: 1, interOpNumThreads: 1 },
});
const answers = [];
for (const run of request.runs) {
    const inputs = run.inputs ? given(run) : await asUser(run);
    const output = await model.generate({ ...inputs, max_new_tokens: request.max_new_tokens, do_sample: false });
    const row = output.tolist()[0].map(Number);
    const promptLength = inputs.input_ids.dims.at(-1);
    answers.push({ tokens: row.slice(promptLength), input_ids: row.slice(0, promptLength) });
}
console.log(JSON.stringify({ answers }));
await model.dispose();

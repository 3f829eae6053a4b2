// transformers.js on one model folder as it is, from the local path (no hub).
//
//   node run.mjs REQUEST.json      (from a copy beside the node_modules it was installed into: harness.py)
//
// REQUEST.json (written by tests/support/transformers_js.py):
//   {"folder": "/abs/path", "dtype": "fp32", "max_new_tokens": 12, "mode": "given" | "as_user",
//    given:   "inputs": {name: {"dtype": "float32" | "int64" | "bool", "dims": [...], "data": base64 of little-endian values}}
//             every input generate() takes: input_ids, attention_mask, pixel_values, and the family's
//             own (image_grid_thw, pixel_attention_mask)
//    as_user: "image": "/abs/path.png", "prompt": "..."  (the folder's processor and chat template)}
// Prints one JSON line: {"tokens": [new token ids], "input_ids": [the prompt's ids]}.
// Greedy, at most max_new_tokens; the folder's generation_config.json's end-of-text tokens stop it.
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
    const Array_ = ARRAYS[dtype];
    // copy: a Buffer's offset into its pool need not be aligned for the typed array
    const values = new Array_(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.byteLength));
    return new Tensor(dtype, values, dims);
}

async function asUser(model) {
    const processor = await AutoProcessor.from_pretrained(modelId);
    const messages = [{ role: 'user', content: [{ type: 'image' }, { type: 'text', text: request.prompt }] }];
    const text = processor.apply_chat_template(messages, { add_generation_prompt: true });
    const image = await RawImage.read(request.image);
    // the template writes the special tokens itself: tokenized without adding any, as transformers'
    // apply_chat_template does (else Gemma 3's prompt starts with two <bos>)
    const options = { add_special_tokens: false };
    // LlavaProcessor alone takes the images first
    return processor.constructor.name === 'LlavaProcessor'
        ? await processor(image, text, options)
        : await processor(text, image, options);
}

async function given() {
    return Object.fromEntries(Object.entries(request.inputs).map(([name, t]) => [name, tensorOf(t)]));
}

const model = await AutoModelForImageTextToText.from_pretrained(modelId, {
    dtype: request.dtype ?? 'fp32',
    device: 'cpu',
    session_options: { intraOpNumThreads: 1, interOpNumThreads: 1 },
});
const inputs = request.mode === 'as_user' ? await asUser(model) : await given();
const output = await model.generate({
    ...inputs,
    max_new_tokens: request.max_new_tokens,
    do_sample: false,
});
const promptLength = inputs.input_ids.dims.at(-1);
const rows = output.tolist().map((row) => row.map(Number));
console.log(JSON.stringify({ tokens: rows[0].slice(promptLength), input_ids: rows[0].slice(0, promptLength) }));
await model.dispose();

// Loads a tiny linear model from the volume once per replica (at module load), then answers with it.
import fs from 'node:fs';

interface Model {
  name: string;
  weights: number[];
  bias: number;
}

const modelPath = process.env.MODEL_PATH ?? '/models/tiny/model.json';
const model = JSON.parse(fs.readFileSync(modelPath, 'utf8')) as Model;

export function run({ x = [] as number[] }) {
  const y = model.weights.reduce((sum, w, i) => sum + w * (x[i] ?? 0), model.bias);
  return { model: model.name, y };
}

// Reads a JSON list of PromQL expressions on stdin; writes, for each, the parse errors and the
// metric names and label names it uses. The parser is the Prometheus project's own Lezer
// grammar (@prometheus-io/lezer-promql), the one Prometheus's web UI parses queries with. It
// checks syntax; the one semantic rule dashboards commonly break (a range on an expression
// that is not a selector) is checked here as Prometheus's server would.
import { parser } from "@prometheus-io/lezer-promql";

let input = "";
for await (const chunk of process.stdin) input += chunk;
const results = JSON.parse(input).map((expr) => {
  const errors = [], metrics = new Set(), labels = new Set();
  parser.parse(expr).iterate({
    enter(node) {
      if (node.name === "MatrixSelector" && node.node.firstChild?.name !== "VectorSelector") {
        // the grammar admits `(expr)[5m]`; Prometheus's Go parser refuses it with this message
        errors.push(`offset ${node.from}: ranges only allowed for vector selectors`);
      }
      if (node.type.isError) {
        errors.push(`offset ${node.from}: ${JSON.stringify(expr.slice(Math.max(0, node.from - 15), node.to + 15))}`);
      } else if (node.name === "Identifier" && node.node.parent?.name === "VectorSelector") {
        metrics.add(expr.slice(node.from, node.to));
      } else if (node.name === "LabelName") {
        labels.add(expr.slice(node.from, node.to));
      }
    },
  });
  return { expr, errors, metrics: [...metrics], labels: [...labels] };
});
process.stdout.write(JSON.stringify(results));

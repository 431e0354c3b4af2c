// Does the hand-written .d.ts of the JS client still describe its .js? Run by
// tests/web/test_js_package.py (with the pinned typescript of tests/js):
//
//   node tests/js/api-check.mjs <typescript package dir> <dir with the .js> <dir with the .d.ts> <module>...
//
// The .js and .d.ts sit in different folders so that the JS is typed by its JSDoc alone. One
// program holds both; for each module it compares the exported API surface and the types:
// - the same value exports (functions, classes, constants), and every type the JS defines
//   (JSDoc @typedef) is declared;
// - classes: the same public instance and static members (members starting with `_` are
//   internal), the JS instance type assignable to the declared one, and the constructor too
//   where the declaration makes it public; functions and constants: the JS type assignable to
//   the declared one;
// - types both define: the same members (or, for unions of literals, the same literals) and
//   assignable both ways.
// Prints one line per drift and exits 1 if there is any.
import { createRequire } from "node:module";
import path from "node:path";

const [tsDir, implDir, declDir, ...modules] = process.argv.slice(2);
if (!tsDir || !implDir || !declDir || modules.length === 0) {
  console.error("usage: api-check.mjs <typescript dir> <impl dir> <decl dir> <module>...");
  process.exit(2);
}
const ts = createRequire(import.meta.url)(path.resolve(tsDir));

const options = {
  allowJs: true,
  checkJs: true,
  strict: true,
  noEmit: true,
  skipLibCheck: false,
  target: ts.ScriptTarget.ES2022,
  module: ts.ModuleKind.ESNext,
  moduleResolution: ts.ModuleResolutionKind.Bundler,
  lib: ["lib.es2022.d.ts", "lib.dom.d.ts"],
};
const files = modules.flatMap((m) => [
  path.resolve(implDir, `${m}.js`),
  path.resolve(declDir, `${m}.d.ts`),
]);
const program = ts.createProgram(files, options);
const checker = program.getTypeChecker();
const problems = [];

const diagnostics = ts.getPreEmitDiagnostics(program);
for (const d of diagnostics) {
  // a peer's own declarations (`ai` for tokenrelay-ai-sdk) are not ours to check: they may
  // need types of their own (@types/node) that our modules never use
  if (d.file && /[\\/]node_modules[\\/](?!typescript[\\/])/.test(d.file.fileName)) continue;
  const where = d.file
    ? `${path.basename(d.file.fileName)}:${d.file.getLineAndCharacterOfPosition(d.start ?? 0).line + 1}`
    : "";
  problems.push(`compile error ${where}: ${ts.flattenDiagnosticMessageText(d.messageText, "\n")}`);
}

const show = (t) => checker.typeToString(t, undefined, ts.TypeFormatFlags.NoTruncation);
const isPublicName = (name) => !name.startsWith("_") && !name.startsWith("__@_");

function resolved(sym) {
  return sym.flags & ts.SymbolFlags.Alias ? checker.getAliasedSymbol(sym) : sym;
}

/** A type the module only names from another module (`@typedef {import(...).X} X`). */
function isImportAlias(sym) {
  if (sym.flags & ts.SymbolFlags.Alias) return true;
  return (sym.declarations ?? []).some((d) => {
    const node = d.typeExpression?.type ?? d.type;
    return node !== undefined && ts.isImportTypeNode(node);
  });
}

function isPrivate(member) {
  return (member.declarations ?? []).some(
    (d) =>
      ts.getCombinedModifierFlags(d) & (ts.ModifierFlags.Private | ts.ModifierFlags.Protected) ||
      (d.name && ts.isPrivateIdentifier(d.name)),
  );
}

function memberNames(type) {
  return checker
    .getPropertiesOfType(type)
    .filter((m) => !isPrivate(m) && isPublicName(m.getName()))
    .map((m) => m.getName())
    .sort();
}

function exportsOf(file) {
  const sf = program.getSourceFile(file);
  const moduleSymbol = sf && checker.getSymbolAtLocation(sf);
  if (!moduleSymbol) throw new Error(`${file}: not a module`);
  const out = new Map();
  for (const sym of checker.getExportsOfModule(moduleSymbol)) out.set(sym.getName(), sym);
  return out;
}

function sameSet(what, a, b) {
  const onlyA = a.filter((x) => !b.includes(x));
  const onlyB = b.filter((x) => !a.includes(x));
  if (onlyA.length) problems.push(`${what}: in the JS but not declared: ${onlyA.join(", ")}`);
  if (onlyB.length) problems.push(`${what}: declared but not in the JS: ${onlyB.join(", ")}`);
}

function assignable(what, from, to) {
  if (!checker.isTypeAssignableTo(from, to)) {
    problems.push(`${what}: the JS type\n    ${show(from)}\n  is not assignable to the declared\n    ${show(to)}`);
  }
}

function literalsOrMembers(type) {
  if (type.isUnion() && type.types.every((t) => t.isLiteral() || t.flags & ts.TypeFlags.BooleanLiteral)) {
    return { literals: type.types.map(show).sort() };
  }
  return { members: memberNames(type) };
}

function publicConstructor(sym) {
  const decls = (sym.declarations ?? []).filter(ts.isClassDeclaration);
  const ctors = decls.flatMap((d) => d.members.filter(ts.isConstructorDeclaration));
  return ctors.every(
    (c) => !(ts.getCombinedModifierFlags(c) & (ts.ModifierFlags.Private | ts.ModifierFlags.Protected)),
  );
}

for (const m of modules) {
  const impl = exportsOf(path.resolve(implDir, `${m}.js`));
  const decl = exportsOf(path.resolve(declDir, `${m}.d.ts`));
  const isValue = (s) => (resolved(s).flags & ts.SymbolFlags.Value) !== 0;
  const isType = (s) => (resolved(s).flags & ts.SymbolFlags.Type) !== 0;
  const implValues = [...impl.keys()].filter((n) => isValue(impl.get(n))).sort();
  const declValues = [...decl.keys()].filter((n) => isValue(decl.get(n))).sort();
  sameSet(`${m}: value exports`, implValues, declValues);

  for (const name of implValues.filter((n) => declValues.includes(n))) {
    const a = resolved(impl.get(name));
    const b = resolved(decl.get(name));
    const what = `${m}.${name}`;
    if (a.flags & ts.SymbolFlags.Class) {
      if (!(b.flags & ts.SymbolFlags.Class)) {
        problems.push(`${what}: a class in the JS, not in the declaration`);
        continue;
      }
      const ai = checker.getDeclaredTypeOfSymbol(a);
      const bi = checker.getDeclaredTypeOfSymbol(b);
      sameSet(`${what} (instance members)`, memberNames(ai), memberNames(bi));
      assignable(`${what} (instance)`, ai, bi);
      const as = checker.getTypeOfSymbol(a);
      const bs = checker.getTypeOfSymbol(b);
      sameSet(`${what} (static members)`, memberNames(as), memberNames(bs));
      if (publicConstructor(b)) assignable(`${what} (constructor)`, as, bs);
      else if (publicConstructor(a) && !(a.declarations ?? []).some(ts.isClassDeclaration)) {
        problems.push(`${what}: constructor visibility differs`);
      }
    } else {
      const at = checker.getTypeOfSymbol(a);
      const bt = checker.getTypeOfSymbol(b);
      if (checker.getSignaturesOfType(at, ts.SignatureKind.Call).length === 0) {
        sameSet(`${what} (members)`, memberNames(at), memberNames(bt));
      }
      assignable(what, at, bt);
    }
  }

  const implTypes = [...impl.keys()].filter(
    (n) => isType(impl.get(n)) && !isValue(impl.get(n)) && !isImportAlias(impl.get(n)),
  );
  for (const name of implTypes.sort()) {
    const what = `${m}.${name} (type)`;
    if (!decl.has(name) || !isType(decl.get(name))) {
      problems.push(`${what}: defined in the JS but not declared`);
      continue;
    }
    const a = checker.getDeclaredTypeOfSymbol(resolved(impl.get(name)));
    const b = checker.getDeclaredTypeOfSymbol(resolved(decl.get(name)));
    const sa = literalsOrMembers(a);
    const sb = literalsOrMembers(b);
    if (sa.literals || sb.literals) sameSet(`${what} (literals)`, sa.literals ?? [], sb.literals ?? []);
    else sameSet(`${what} (members)`, sa.members, sb.members);
    assignable(`${what} JS to declared`, a, b);
    assignable(`${what} declared to JS`, b, a);
  }
  console.log(
    `${m}: ${implValues.length} value exports, ${implTypes.length} JSDoc types checked` +
      ` against ${path.basename(declDir)}/${m}.d.ts`,
  );
}

if (problems.length) {
  console.log(`${problems.length} drift(s) between the JS and its .d.ts:`);
  for (const p of problems) console.log(`- ${p}`);
  process.exit(1);
}
console.log("ok: the .d.ts files match the JSDoc");

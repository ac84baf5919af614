// tests/emulated/fiber_switch.hpp — the emulator's threads' stacks: starting a function
// on a stack of its own and switching between stacks.
//
// On x86-64 a switch saves the callee-saved registers, the SSE and x87 control words
// and the stack pointer, and loads another's: a dozen instructions. ucontext's
// swapcontext also saves the signal mask, a system call per switch, which made that
// call most of the emulated tests' time; the barrier-heavy kernels switch millions
// of times. ucontext stays where that switch would be wrong or unseen: under
// AddressSanitizer (which follows swapcontext) and ThreadSanitizer, with CET's shadow
// stack possible (-fcf-protection: a return to another stack would fault), and
// elsewhere than 64-bit x86-64.
#pragma once
#include <ucontext.h>

#include <cstddef>  // std::size_t
#include <cstdint>  // std::uintptr_t, std::uint64_t

#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define CUDA_EMULATOR_UCONTEXT 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || defined(__CET__) || !defined(__x86_64__) || \
    !defined(__LP64__)
#define CUDA_EMULATOR_UCONTEXT 1
#endif

namespace cuda_emulator {

#if defined(CUDA_EMULATOR_UCONTEXT)

struct context {
  ucontext_t uc{};
};
// Makes `c` start entry() on [stack, stack + bytes) when switched to.
inline void prepare(context& c, char* stack, std::size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;  // entry never returns: it switches away for good
  makecontext(&c.uc, entry, 0);
}
inline void switch_context(context& from, const context& to) { swapcontext(&from.uc, &to.uc); }

#else

struct context {
  void* sp = nullptr;  // the stack pointer saved by the last switch away
};

namespace detail {
// Saves rbp, rbx, r12-r15, MXCSR and the x87 control word on the current stack,
// stores the stack pointer in *from, loads `to` and restores the same from there.
[[gnu::naked, gnu::noinline]] inline void switch_stack(void** /*from*/, void* /*to*/) {
  asm("pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "subq $8, %rsp\n\t"
      "stmxcsr (%rsp)\n\t"
      "fnstcw 4(%rsp)\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "ldmxcsr (%rsp)\n\t"
      "fldcw 4(%rsp)\n\t"
      "addq $8, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret");
}
// Where a new stack's first switch returns to: calls r13 (the entry), with the stack
// 16-byte aligned as the ABI wants at a call; the entry never returns.
[[gnu::naked, gnu::noinline]] inline void first_return() {
  asm("callq *%r13\n\t"
      "ud2");
}
}  // namespace detail

inline void prepare(context& c, char* stack, std::size_t bytes, void (*entry)()) {
  auto top = (reinterpret_cast<std::uintptr_t>(stack) + bytes) & ~std::uintptr_t(15);
  auto* frame = reinterpret_cast<std::uint64_t*>(top - 16 - 8 * 8);  // 16-byte aligned
  std::uint32_t mxcsr = 0;
  std::uint16_t x87 = 0;
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(mxcsr), "=m"(x87));  // the caller's, as getcontext takes them
  frame[0] = mxcsr | (std::uint64_t(x87) << 32);
  frame[1] = frame[2] = 0;                             // r15, r14
  frame[3] = reinterpret_cast<std::uint64_t>(entry);   // r13
  frame[4] = frame[5] = frame[6] = 0;                  // r12, rbx, rbp
  frame[7] = reinterpret_cast<std::uint64_t>(&detail::first_return);
  c.sp = frame;
}
inline void switch_context(context& from, const context& to) { detail::switch_stack(&from.sp, to.sp); }

#endif

}  // namespace cuda_emulator
